"""Training data: SeqIO tasks and mixtures, vocabularies, an embedded corpus, a token store, one resumable stream.

One path: a task's documents are tokenized once into a token store (sparsetx-tokenize, or the trainer itself into
<workdir>/tokenized for a config without config.data.tokenized_dir), and the trainer reads rows of it.

Files, one concern each:
  corpus.py         the embedded corpus (stories, facts), generated deterministically; `facts()`, `characters()`
  vocab.py          `make_vocabulary(config.data, model_vocab_size)`: byte (default), SentencePiece or GPT-2 BPE
  bpe_vocab.py      reading a GPT-2 byte-level BPE from local files (vocab.json + merges.txt, or tokenizer.json)
  encoders.py       each vocabulary's native batch encoder (tokenizers' encode_batch, SentencePiece's C++, NumPy)
  sources.py        config.data.sources -> seqio DataSource (text, jsonl, tfrecord, tfds, parquet, datasets; embedded)
  documents.py      documents of corpora as they ship, streamed in Python: text, JSON lines (.gz, .zst), parquet,
                    datasets folders; sharded as seqio shards files
  preprocessors.py  text extraction, blank-document filter, splitting documents into seq_len pieces
  tasks.py          registers tasks `sparsetx.<name>` and the mixture `sparsetx.mixture` with seqio
  pretokenize.py    `tokenize_corpus(config, output_dir, workers)`: the tasks' whole documents into token shards
                    (sparsetx-tokenize; resumable, worker processes); `train_corpus`: the trainer's corpus
  token_store.py    token shards read by row
  packing.py        packed features of rows cut from a token stream
  batches.py        a process's block of batch rows; the global jax.Array batch
  global_stream.py  batch of step s = f(data config, seed, s), resumable on any process count; `TokenizedEvalData`
  file_checks.py    `check_files(config)`: the files config.data names exist (sources, TFDS data_dir, tokenizer)

Defaults need nothing outside the package: `config.data.mixture = (('stories', 0.7), ('facts', 0.3))`,
byte vocabulary, seq_len 256, global batch 16, packing on.

Your own data: define a source and put it in the mixture (rates are relative weights per row of seq_len tokens):

  config.data.sources.web = ml_collections.ConfigDict(dict(
      kind="jsonl", train="/data/web/train-*.jsonl", validation="/data/web/val.jsonl", text_field="text"))
  config.data.mixture = (("web", 0.9), ("facts", 0.1))

  kind="text"      one document per line; blank lines are skipped
  kind="jsonl"     one JSON object per line; `text_field` holds the document; .gz and .zst files decompressed
  kind="parquet"   parquet files; the string column `text_field` holds the document (read by row group)
  kind="datasets"  a folder written by datasets' save_to_disk (one split's folder), column `text_field`
  kind="tfrecord"  tf.train.Example records with a bytes feature `text_field`
  kind="tfds"      a prepared TFDS dataset: tfds_name="name:1.0.0", data_dir=..., train/validation are
                   TFDS split names (e.g. "train", "validation[:5%]"); read-only, nothing is downloaded
  train / validation are a path, a glob or a tuple of them (validation optional).

Tokenize a real corpus once, with workers: `sparsetx-tokenize --config=... --output_dir=DIR --workers=N`, then
train with `--config.data.tokenized_dir=DIR`. Each split gets one shard per input file (at least one per worker).

SentencePiece: `python -m sparsetx.tools.build_vocab --output=/data/spm/web --vocab_size=8192 --input=...`
then `config.data.vocab = dict(kind="sentencepiece", path="/data/spm/web.model")` and
`config.model.vocab_size >= 8192`.

GPT-2 BPE: `config.data.vocab = dict(kind="gpt2", path=DIR)` with DIR holding vocab.json + merges.txt
(GPT-2's own files: 50,258 ids after "!" moves off id 0, the padding id; `config.model.vocab_size=50304`),
or your own: `python -m sparsetx.tools.build_vocab --kind=gpt2 --output=/data/bpe --vocab_size=8192 --input=...`.

Resume: the stream's state is a step number and a fingerprint (global_stream.py), an item of each checkpoint
step, restored on any number of processes.

Importing this package is cheap; TensorFlow and seqio load with the modules that need them.
"""

from sparsetx.data.file_checks import check_files, check_training_files  # noqa: F401  (light: no TensorFlow)

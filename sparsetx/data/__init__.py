"""Training data: SeqIO tasks and mixtures, vocabularies, an embedded corpus, a resumable per-host pipeline.

Files, one concern each:
  corpus.py         the embedded corpus (stories, facts), generated deterministically; `facts()`, `characters()`
  vocab.py          `make_vocabulary(config.data, model_vocab_size)`: byte (default), SentencePiece or GPT-2 BPE
  bpe_vocab.py      reading a GPT-2 byte-level BPE from local files (vocab.json + merges.txt, or tokenizer.json)
  sources.py        config.data.sources -> seqio DataSource (text, jsonl, tfrecord, tfds, parquet, datasets; embedded)
  documents.py      streamed documents of corpora as they ship: parquet, JSON lines (.gz, .zst), datasets folders
  preprocessors.py  text extraction, blank-document filter, splitting documents into seq_len pieces
  tasks.py          registers tasks `sparsetx.<name>` and the mixture `sparsetx.mixture` with seqio
  pipeline.py       `make_train_iterator`, `make_eval_iterator` / `EvalData`: global jax.Array batches (on the fly)
  token_store.py    pre-tokenized corpora (sparsetx-tokenize): token shards read by row
  packing.py        packed features of rows cut from a token stream
  global_stream.py  the tokenized path: batch of step s = f(data config, seed, s), resumable on any process count;
                    `make_train_data` / `make_eval_data` pick it when config.data.tokenized_dir is set
  file_checks.py    `check_files(config)`: the files config.data names exist (sources, TFDS data_dir, tokenizer)
  pretokenize.py    `tokenize_corpus(config, output_dir, workers)`: the tasks' whole documents into token shards
                    (sparsetx-tokenize; resumable, worker processes)

Defaults need nothing outside the package: `config.data.mixture = (('stories', 0.7), ('facts', 0.3))`,
byte vocabulary, seq_len 256, global batch 16, packing on.

Your own data: define a source and put it in the mixture (rates are relative weights per example,
where an example is a document piece of at most seq_len tokens):

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
  parquet, datasets and compressed JSON lines are read by sparsetx-tokenize only; train on the tokenized corpus.

Write at least as many files per split as there are processes (seqio then gives each process whole
files); otherwise every process reads everything and keeps every n-th document.

SentencePiece: `python -m sparsetx.tools.build_vocab --output=/data/spm/web --vocab_size=8192 --input=...`
then `config.data.vocab = dict(kind="sentencepiece", path="/data/spm/web.model")` and
`config.model.vocab_size >= 8192`.

GPT-2 BPE: `config.data.vocab = dict(kind="gpt2", path=DIR)` with DIR holding vocab.json + merges.txt
(GPT-2's own files: 50,258 ids after "!" moves off id 0, the padding id; `config.model.vocab_size=50304`),
or your own: `python -m sparsetx.tools.build_vocab --kind=gpt2 --output=/data/bpe --vocab_size=8192 --input=...`.

Pre-tokenized: `config.data.tokenized_dir = DIR` (written by sparsetx-tokenize) trains without a tokenizer; the
data state is a step number and a fingerprint (see global_stream.py), restored on any number of processes.

Resume (on the fly): `iterator.save(dir)` / `iterator.restore(dir)` on every process (see pipeline.py). The state
is a tf.train.Checkpoint of the tf.data iterator (file offsets, sampler RNG, shuffle and packing
buffers) plus data_state.json; restoring never re-reads consumed data. Its size is about
shuffle_buffer pieces per task per process.

Importing this package is cheap; TensorFlow and seqio load with the modules that need them.
"""

from sparsetx.data.file_checks import check_files, check_training_files  # noqa: F401  (light: no TensorFlow)

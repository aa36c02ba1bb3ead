"""Trains a vocabulary on local text: SentencePiece (default) or a GPT-2-format byte-level BPE (--kind=gpt2).

  python -m sparsetx.tools.build_vocab --output=/data/spm/tinystories --vocab_size=8192       --input=/data/train.txt --input=/data/more.jsonl
  # then: --config.data.vocab.kind=sentencepiece --config.data.vocab.path=/data/spm/tinystories.model

  python -m sparsetx.tools.build_vocab --kind=gpt2 --output=/data/bpe/tinystories --vocab_size=8192 --input=...
  # writes /data/bpe/tinystories/{vocab.json,merges.txt}; then --config.data.vocab.kind=gpt2
  # --config.data.vocab.path=/data/bpe/tinystories

More: docs/modules.md, sparsetx/tools/build_vocab.py.
"""

import glob
import itertools
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from types import SimpleNamespace

import sentencepiece as spm
from absl import flags

from sparsetx import cli
from sparsetx.data import corpus


def documents(inputs: list[str], text_field: str) -> Iterator[str]:
  """Yields the non-blank documents of the inputs (or of the embedded corpus when none)."""
  if not inputs:
    yield from corpus.stories("train")
    yield from corpus.fact_documents("train")
    return
  for path in inputs:
    with open(path, encoding="utf-8") as f:
      for number, line in enumerate(f, 1):
        if path.endswith(".jsonl"):
          if not line.strip():
            continue
          try:
            line = json.loads(line)[text_field]
          except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(
              f"{path}:{number} is not a JSON object with a string field {text_field!r} ({error!r}); "
              "fix the line or pass --text_field."
            ) from error
        line = line.rstrip("\n")
        if line.strip():
          yield line


def expand_inputs(patterns: list[str]) -> list[str]:
  """Expands globs; a pattern matching nothing, or an empty file, is an error naming it."""
  files = []
  for pattern in patterns:
    matched = sorted(glob.glob(os.path.expanduser(pattern)))
    if not matched:
      raise ValueError(f"--input={pattern!r} matches no file; check the path.")
    for path in matched:
      if os.path.getsize(path) == 0:
        raise ValueError(f"--input file {path!r} is empty; fill it or leave it out.")
    files.extend(matched)
  return files


def build_vocab(
  output: str,
  vocab_size: int,
  inputs: list[str] = (),
  model_type: str = "bpe",
  text_field: str = "text",
  max_documents: int = 1_000_000,
  seed: int = 0,
) -> str:
  """Trains the model and returns the path of the written `<output>.model`."""
  files = expand_inputs(list(inputs))
  directory = os.path.dirname(os.path.abspath(output))
  os.makedirs(directory, exist_ok=True)
  spm.set_random_generator_seed(seed)  # the document sample and BPE ties are then reproducible
  spm.SentencePieceTrainer.train(
    sentence_iterator=documents(files, text_field),
    model_prefix=output,
    vocab_size=vocab_size,
    model_type=model_type,
    pad_id=0,
    eos_id=1,
    unk_id=2,
    bos_id=-1,
    byte_fallback=True,
    character_coverage=1.0,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    split_digits=True,
    input_sentence_size=max_documents,
    shuffle_input_sentence=True,
    max_sentence_length=1 << 16,
    num_threads=os.cpu_count() or 1,
    minloglevel=2,
  )
  return output + ".model"


GPT2_SPECIAL_TOKENS = ("<pad>", "<|endoftext|>")  # ids 0 and 1: padding (seqio's id 0) and EOS
GPT2_MIN_VOCAB_SIZE = 256 + len(GPT2_SPECIAL_TOKENS) + 1  # the bytes, the specials and at least one merge


def build_gpt2_bpe(
  output: str, vocab_size: int, inputs: list[str] = (), text_field: str = "text", max_documents: int = 1_000_000
) -> str:
  """Trains a byte-level BPE and writes `<output>/vocab.json` and `merges.txt` (GPT-2's format); returns `output`.

  The files are written beside the targets and renamed over them, so a failed run damages no earlier vocabulary.
  """
  from tokenizers import models, pre_tokenizers, trainers  # only this kind needs tokenizers

  from sparsetx.data import bpe_vocab

  files = expand_inputs(list(inputs))
  tokenizer = bpe_vocab.gpt2_byte_level(models.BPE())  # the splitting the reader uses
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(GPT2_SPECIAL_TOKENS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen in the text or not
    show_progress=False,
  )
  tokenizer.train_from_iterator(itertools.islice(documents(files, text_field), max_documents), trainer)
  os.makedirs(output, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=output, prefix=".build_vocab-") as scratch:
    for written in tokenizer.model.save(scratch):
      os.replace(written, os.path.join(output, os.path.basename(written)))
  return output


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    kind=flags.DEFINE_enum(
      "kind",
      "sentencepiece",
      ["sentencepiece", "gpt2"],
      "sentencepiece: <output>.model; gpt2: <output>/vocab.json + merges.txt (GPT-2 format).",
    ),
    output=flags.DEFINE_string(
      "output",
      None,
      "sentencepiece: path prefix, writes <output>.model and <output>.vocab; gpt2: a directory.",
      required=True,
    ),
    vocab_size=flags.DEFINE_integer("vocab_size", 8192, "Vocabulary size."),
    input=flags.DEFINE_multi_string("input", [], "Text or .jsonl file or glob; repeatable."),
    model_type=flags.DEFINE_enum("model_type", "bpe", ["bpe", "unigram"], "sentencepiece only."),
    text_field=flags.DEFINE_string("text_field", "text", "Field of .jsonl inputs."),
    max_documents=flags.DEFINE_integer("max_documents", 1_000_000, "Documents sampled for training."),
    seed=flags.DEFINE_integer("seed", 0, "sentencepiece only (its document sample)."),
  )


def absl_main(argv: list[str], flag_values: dict) -> int:
  del argv  # words that are no flags: refused by cli.run
  args = cli.flag_values(flag_values)
  if args.kind == "gpt2":
    return main_gpt2(args)
  if args.vocab_size <= 259:
    print(
      f"error: --vocab_size={args.vocab_size} leaves no room beyond the 256 byte-fallback pieces and "
      "3 special ids; use at least 260 (8192 is typical).",
      file=sys.stderr,
    )
    return 2
  try:
    path = build_vocab(
      args.output, args.vocab_size, args.input, args.model_type, args.text_field, args.max_documents, args.seed
    )
  except (ValueError, RuntimeError, OSError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  size = spm.SentencePieceProcessor(model_file=path).get_piece_size()
  print(
    f"wrote {path} ({size} pieces); use --config.data.vocab.kind=sentencepiece "
    f"--config.data.vocab.path={path} and config.model.vocab_size >= {size}"
  )
  return 0


def main_gpt2(args: SimpleNamespace) -> int:
  if args.vocab_size < GPT2_MIN_VOCAB_SIZE:
    print(
      f"error: --vocab_size={args.vocab_size} leaves no room for merges beyond the 256 byte tokens and "
      f"{', '.join(GPT2_SPECIAL_TOKENS)}; use at least {GPT2_MIN_VOCAB_SIZE} (8192 is typical).",
      file=sys.stderr,
    )
    return 2
  if os.path.isfile(args.output):
    print(
      f"error: --output={args.output!r} is a file; --kind=gpt2 writes a directory (vocab.json + merges.txt).",
      file=sys.stderr,
    )
    return 2
  try:
    output = build_gpt2_bpe(args.output, args.vocab_size, args.input, args.text_field, args.max_documents)
  except (ValueError, RuntimeError, OSError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  with open(os.path.join(output, "vocab.json"), encoding="utf-8") as f:
    size = len(json.load(f))
  print(
    f"wrote {output}/vocab.json and merges.txt ({size} tokens, <pad>=0, <|endoftext|>=1); use "
    f"--config.data.vocab.kind=gpt2 --config.data.vocab.path={output} and config.model.vocab_size >= {size}"
  )
  if size < args.vocab_size:  # the trainer stops early only when no pair of adjacent tokens is left to merge
    with open(os.path.join(output, "merges.txt"), encoding="utf-8") as f:
      merges = sum(1 for line in f if line.strip() and not line.startswith("#"))
    print(
      f"{size} < --vocab_size={args.vocab_size}: after {merges} merges every word of the training text is one "
      "token, so no pair is left to merge; more (or more varied) text gives a larger vocabulary."
    )
  return 0


def main():
  """The `sparsetx-build-vocab` entry point."""
  values = define_flags()
  cli.run(lambda argv: absl_main(argv, values))


if __name__ == "__main__":
  main()

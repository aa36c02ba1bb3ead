"""Trains a SentencePiece vocabulary on local text, for `config.data.vocab.kind='sentencepiece'`.

  python tools/build_vocab.py --output=/data/spm/tinystories --vocab_size=8192 \
      --input=/data/train.txt --input=/data/more.jsonl
  # then: --config.data.vocab.kind=sentencepiece --config.data.vocab.path=/data/spm/tinystories.model

Inputs are text files (one document per line) or JSONL files (`*.jsonl`, field --text_field);
with no --input it trains on the embedded corpus (stories and facts, train split). The model
uses seqio's ids (pad=0, eos=1, unk=2, no bos) and byte fallback with identity normalization,
so every string round-trips exactly through encode/decode. The sgatlin paper used an
8,192-piece BPE for TinyStories, hence the defaults. Nothing is downloaded.
"""

import argparse
import glob
import json
import os
import sys
from typing import Iterator

import sentencepiece as spm

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


def build_vocab(output: str, vocab_size: int, inputs: list[str] = (), model_type: str = "bpe",
                text_field: str = "text", max_documents: int = 1_000_000, seed: int = 0) -> str:
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


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--output", required=True, help="path prefix; writes <output>.model and <output>.vocab")
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--input", action="append", default=[], help="text or .jsonl file or glob; repeatable")
  parser.add_argument("--model_type", choices=("bpe", "unigram"), default="bpe")
  parser.add_argument("--text_field", default="text", help="field of .jsonl inputs")
  parser.add_argument("--max_documents", type=int, default=1_000_000, help="documents sampled for training")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.vocab_size <= 259:
    print(f"error: --vocab_size={args.vocab_size} leaves no room beyond the 256 byte-fallback pieces and "
          "3 special ids; use at least 260 (8192 is typical).", file=sys.stderr)
    return 2
  try:
    path = build_vocab(args.output, args.vocab_size, args.input, args.model_type, args.text_field,
                       args.max_documents, args.seed)
  except (ValueError, RuntimeError, OSError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  size = spm.SentencePieceProcessor(model_file=path).get_piece_size()
  print(f"wrote {path} ({size} pieces); use --config.data.vocab.kind=sentencepiece "
        f"--config.data.vocab.path={path} and config.model.vocab_size >= {size}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

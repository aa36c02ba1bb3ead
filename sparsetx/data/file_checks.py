"""Checks that the files a config names exist, run by every program before it builds anything.

`sparsetx.config.validate` never touches the file system; the data sources' files, a TFDS data_dir and
the tokenizer files are checked here, next to the code that opens them, with the same one-line
`ConfigError` naming the field. Light: no TensorFlow or seqio (the GPT-2 BPE loads `tokenizers`).
"""

import glob
import os

import ml_collections

from sparsetx import config as config_lib


def check_patterns(field: str, patterns: tuple) -> None:
  """Each local pattern must match at least one file and no matched file may be empty."""
  for pattern in patterns:
    config_lib.require(
      isinstance(pattern, str) and pattern, f"{field}={patterns!r} holds an empty path; give a file path or glob."
    )
    if "://" in pattern:
      continue  # remote (gs://, s3://): checked when the tokenize job lists the files
    files = sorted(glob.glob(os.path.expanduser(pattern)))
    config_lib.require(bool(files), f"{field}: no file matches {pattern!r}; check the path or create the file.")
    for path in files:
      config_lib.require(
        os.path.getsize(path) > 0,
        f"{field}: file {path!r} is empty; fill it or remove it from the pattern.",
      )


def check_source_files(source: ml_collections.ConfigDict, prefix: str) -> None:
  """The files of one `config.data.sources.<name>` (`prefix`): its TFDS data_dir, or its train/validation files."""
  if source.get("kind") == "tfds":
    data_dir = source.get("data_dir")
    config_lib.require(
      bool(data_dir) and ("://" in data_dir or os.path.isdir(data_dir)),
      f"{prefix}.data_dir={data_dir!r} is not a directory; point it at the prepared TFDS data (nothing is downloaded).",
    )
  elif source.get("kind") == "datasets":
    from sparsetx.data import documents  # pyarrow, no TensorFlow

    for key in ("train", "validation"):
      for folder in config_lib.source_patterns(source.get(key)):
        try:
          check_patterns(f"{prefix}.{key}", tuple(documents.datasets_files(folder)))
        except documents.DocumentError as error:
          raise config_lib.ConfigError(f"{prefix}.{key}: {error}") from None
  else:
    check_patterns(f"{prefix}.train", config_lib.source_patterns(source.get("train")))
    check_patterns(f"{prefix}.validation", config_lib.source_patterns(source.get("validation")))


def check_vocab_files(
  data: ml_collections.ConfigDict, model: ml_collections.ConfigDict | None = None, prefix: str = "config.data"
) -> None:
  """The tokenizer files of `config.data.vocab`; given `model`, a GPT-2 BPE must fit config.model.vocab_size."""
  if data.vocab.kind == "sentencepiece":
    path = data.vocab.path
    config_lib.require(
      bool(path) and ("://" in path or os.path.isfile(path)),
      f"{prefix}.vocab.path={path!r} is not a file; build one with python -m sparsetx.tools.build_vocab.",
    )
  if data.vocab.kind == "gpt2":
    from sparsetx.data import bpe_vocab  # tokenizers only, no TensorFlow; imported here so this module stays light

    gpt2 = bpe_vocab.load(data.vocab.path, f"{prefix}.vocab.path")  # missing or bad files: one clear error
    if model is not None:
      config_lib.require(
        gpt2.vocab_size <= model.vocab_size,
        f"config.model.vocab_size={model.vocab_size} is smaller than the GPT-2 BPE of {prefix}.vocab.path="
        f"{data.vocab.path!r} ({gpt2.vocab_size} ids); raise config.model.vocab_size (a multiple of 64 is "
        "fastest, e.g. 50304 for GPT-2's files).",
      )


def check_tokenized_dir(tokenized_dir: str) -> None:
  """A tokenized corpus must have its manifest (written last by sparsetx-tokenize); its shards are checked where
  they are opened."""
  from sparsetx.data import token_store  # tensorstore, no TensorFlow

  try:
    token_store.read_manifest(tokenized_dir)
  except token_store.CorpusError as error:
    raise config_lib.ConfigError(f"config.data.tokenized_dir={tokenized_dir!r}: {error}") from None


def check_files(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks every file config.data names (after `config_lib.validate`); returns the config unchanged."""
  sources = config.data.sources or {}
  for name in sources:
    check_source_files(sources[name], f"config.data.sources.{name}")
  check_vocab_files(config.data, config.model)
  return config


def check_training_files(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The files training reads: with config.data.tokenized_dir that corpus and the vocabulary (the sources' files
  need not be on a training host), else `check_files` (the trainer tokenizes them first). Returns the config."""
  if not config.data.tokenized_dir:
    return check_files(config)
  check_tokenized_dir(config.data.tokenized_dir)
  check_vocab_files(config.data, config.model)
  return config

"""Data sources: one seqio DataSource per task, with the preprocessor that turns its records into text.

More: docs/modules.md, sparsetx/data/sources.py.
"""

from collections.abc import Callable

import ml_collections
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from sparsetx import config as config_lib
from sparsetx.data import corpus, documents, preprocessors

Preprocessor = Callable[[tf.data.Dataset], tf.data.Dataset]


def _files(field: str, patterns: tuple[str, ...]) -> list[str]:
  """Lists files (local or remote) with a clear error for a pattern that matches nothing."""
  files = []
  for pattern in patterns:
    matched = seqio.utils.list_files(pattern)
    if not matched:
      raise config_lib.ConfigError(f"{field}: no file matches {pattern!r}; check the path or create the file.")
    files.extend(matched)
  return files


def _check_prepared_tfds(
  prefix: str, source: ml_collections.ConfigDict, data_source: seqio.TfdsDataSource, splits: dict[str, str]
) -> None:
  """Opens the prepared TFDS dataset now, so a missing dataset or split is one clear error here, not deep in tf.data.

  `tfds.builder` reads a dataset's files from `data_dir` when its builder class is not imported, so a
  dataset prepared elsewhere (e.g. `tfds build --data_dir=...`) needs no code here.
  """
  name, data_dir = source.tfds_name, source.data_dir
  try:
    builder = data_source.tfds_dataset.builder
    prepared = builder.is_prepared()
  except (tfds.core.registered.DatasetNotFoundError, ValueError, OSError):
    prepared = False
  if not prepared:
    present = sorted(d for d in tf.io.gfile.listdir(data_dir) if tf.io.gfile.isdir(f"{data_dir}/{d}"))
    raise config_lib.ConfigError(
      f"{prefix}.tfds_name={name!r} is not a prepared TFDS dataset in {prefix}.data_dir={data_dir!r} (it holds "
      f"{', '.join(present) or 'no dataset'}); prepare it there first (e.g. `tfds build --data_dir=...`) or fix "
      "the name: nothing is downloaded."
    )
  for key, split in splits.items():
    try:
      builder.info.splits[split]
    except (KeyError, ValueError, AssertionError) as error:
      raise config_lib.ConfigError(
        f"{prefix}.{key}={split!r} is not a split of TFDS dataset {name!r} (it has "
        f"{', '.join(builder.info.splits)}); use one of them, optionally sliced like 'train[:5%]'."
      ) from error


def _streamed_source(split_files: dict, read, field: str) -> seqio.DataSource:
  """A file source whose files are read by `read(path, field)` (documents.py), each document one string."""

  def read_file(path: tf.Tensor) -> tf.data.Dataset:
    return tf.data.Dataset.from_generator(
      lambda p: read(p.decode(), field), args=(path,), output_signature=tf.TensorSpec((), tf.string)
    )

  return seqio.FileDataSource(read_file_fn=read_file, split_to_filepattern=split_files)


def _patterns(source: ml_collections.ConfigDict) -> tuple:
  return config_lib.source_patterns(source.get("train")) + config_lib.source_patterns(source.get("validation"))


def _embedded_source(name: str) -> seqio.DataSource:
  documents = corpus.DOCUMENTS[name]

  def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
    del shuffle_files, seed  # one in-memory "file"; the task's shuffle buffer shuffles examples
    return tf.data.Dataset.from_tensor_slices(list(documents(split)))

  return seqio.FunctionDataSource(dataset_fn, splits=corpus.SPLITS)


def make_source(name: str, source: ml_collections.ConfigDict | None) -> tuple[seqio.DataSource, Preprocessor]:
  """The DataSource of task `name` and the preprocessor mapping its records to {'targets': text}."""
  if source is None:
    if name not in corpus.DOCUMENTS:
      raise config_lib.ConfigError(
        f"task {name!r} is neither built in ({', '.join(corpus.DOCUMENTS)}) nor defined under "
        f"config.data.sources.{name}; define it there."
      )
    return _embedded_source(name), preprocessors.text_line_to_targets
  prefix = f"config.data.sources.{name}"
  kind = source.kind
  field = source.get("text_field", "text")
  if kind == "tfds":
    splits = {"train": source.train}
    if source.get("validation"):
      splits["validation"] = source.validation
    data_source = seqio.TfdsDataSource(
      tfds_name=source.tfds_name, tfds_data_dir=source.data_dir, splits=splits, read_only=True
    )
    _check_prepared_tfds(prefix, source, data_source, splits)
    return data_source, preprocessors.field_to_targets(field)
  if kind == "datasets":  # a folder per split: its data files, in order
    split_files = {
      key: [path for folder in config_lib.source_patterns(source.get(key)) for path in documents.datasets_files(folder)]
      for key in ("train", "validation")
      if source.get(key)
    }
    return _streamed_source(split_files, documents.arrow_documents, field), preprocessors.text_line_to_targets
  split_files = {"train": _files(f"{prefix}.train", config_lib.source_patterns(source.train))}
  validation = config_lib.source_patterns(source.get("validation"))
  if validation:
    split_files["validation"] = _files(f"{prefix}.validation", validation)
  if kind == "parquet":
    return _streamed_source(split_files, documents.parquet_documents, field), preprocessors.text_line_to_targets
  if kind == "jsonl" and any(p.endswith(documents.COMPRESSED) for p in _patterns(source)):
    return _streamed_source(split_files, documents.jsonl_documents, field), preprocessors.text_line_to_targets
  if kind == "text":
    return seqio.TextLineDataSource(split_files), preprocessors.text_line_to_targets
  if kind == "jsonl":
    return seqio.TextLineDataSource(split_files), preprocessors.jsonl_to_targets(field)
  if kind == "tfrecord":
    features = {field: tf.io.FixedLenFeature([], tf.string)}
    return seqio.TFExampleDataSource(split_files, feature_description=features), preprocessors.field_to_targets(field)
  raise config_lib.ConfigError(
    f"{prefix}.kind={kind!r} is unknown; use one of {', '.join(map(repr, config_lib.DATA_SOURCE_KINDS))}."
  )

"""Task preprocessors that seqio does not provide: read a text field, drop blanks, split long documents.

The packer (seqio's feature converter) truncates any example longer than the row length, which
would silently lose the tail of every long document. `split_to_length` cuts tokenized documents
into pieces of at most `sequence_length["targets"]` tokens first, so packing loses no token; each
piece becomes its own segment (positions restart at 0), as in T5's `split_tokens`.
"""

import json

import tensorflow as tf


def text_line_to_targets(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """A line of a text file is one document."""
  return dataset.map(lambda line: {"targets": line}, num_parallel_calls=tf.data.AUTOTUNE)


def field_to_targets(field: str):
  """Keeps only the string feature `field` (TFRecord, TFDS), renamed to `targets`."""

  def preprocess(dataset: tf.data.Dataset) -> tf.data.Dataset:
    if field not in dataset.element_spec:
      raise ValueError(
        f"text_field={field!r} is not a feature of this dataset; use one of "
        f"{sorted(dataset.element_spec)} (config.data.sources.<name>.text_field)."
      )
    return dataset.map(lambda example: {"targets": example[field]}, num_parallel_calls=tf.data.AUTOTUNE)

  return preprocess


def jsonl_to_targets(field: str):
  """Parses each JSON line and keeps the string `field`.

  JSON has no TensorFlow parser, so this runs `json.loads` in a `tf.py_function` (the seqio task other tools
  read; the tokenize job reads JSON lines in Python, documents.py). A line that is not JSON, or lacks the field,
  stops the dataset with its text and the fix.
  """

  def parse(line: tf.Tensor) -> bytes:
    text = line.numpy().decode("utf-8")
    try:
      record = json.loads(text)
    except json.JSONDecodeError as error:
      raise ValueError(f"a JSONL line is not valid JSON ({error}): {text[:200]!r}") from error
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str):
      raise ValueError(
        f"a JSONL line has no string field {field!r} (set config.data.sources.<name>.text_field): {text[:200]!r}"
      )
    return value.encode("utf-8")

  def to_example(line: tf.Tensor) -> dict[str, tf.Tensor]:
    text = tf.py_function(parse, [line], tf.string)
    text.set_shape([])
    return {"targets": text}

  def preprocess(dataset: tf.data.Dataset) -> tf.data.Dataset:
    return dataset.map(to_example, num_parallel_calls=tf.data.AUTOTUNE)

  return preprocess


def drop_blank(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """Blank documents (empty lines) would become rows holding only an EOS; skip them."""
  return dataset.filter(lambda example: tf.strings.length(tf.strings.strip(example["targets"])) > 0)


def split_to_length(dataset: tf.data.Dataset, sequence_length: dict[str, int]) -> tf.data.Dataset:
  """Cuts each tokenized document into consecutive pieces of at most the row length."""
  length = sequence_length["targets"]

  def pieces(example: dict[str, tf.Tensor]) -> tf.data.Dataset:
    tokens_L = example["targets"]
    starts = tf.range(0, tf.size(tokens_L, out_type=tf.int64), length)
    rows = tf.RaggedTensor.from_row_starts(tokens_L, starts)
    return tf.data.Dataset.from_tensor_slices({"targets": rows})

  return dataset.flat_map(pieces)

"""Documents from corpus files as they ship, streamed in pure Python (no TensorFlow): text lines, parquet files by
row group (FineWeb), JSON lines plain, gzip or zstd (Dolma, C4, the Pile), and `datasets` folders written by
`save_to_disk` (Arrow stream files, by record batch). Memory stays at one row group, one record batch or one 1 MiB
chunk, whatever the file size; `shard_documents` splits a split's files into shards as seqio does.

A bad file (damaged parquet, a truncated .gz or .zst, a line that is not JSON, a missing text column, text that is
not UTF-8) is a `DocumentError` naming the file, the row or byte offset, and the fix.
"""

import itertools
import json
import os
import zlib
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from etils import epath

from sparsetx.config import ConfigError

CHUNK_BYTES = 1 << 20
COMPRESSED = (".gz", ".zst")  # JSON lines and text files decompressed by suffix
BLANK = " \t\n\v\f\r"  # what TensorFlow's strip (the seqio task's blank filter) removes
FIELD_FIX = "set config.data.sources.<name>.text_field to the column that holds the text"


class DocumentError(ConfigError):  # bad input: one `error:` line and exit 2 in every program
  """A corpus file cannot be read as documents; the message names the file, where, and the fix."""


def _text_values(path: str, column, first_row: int, field: str) -> Iterator[str]:
  if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
    raise DocumentError(f"{path}: column {field!r} holds {column.type}, not text; {FIELD_FIX}.")
  for offset, value in enumerate(column.to_pylist()):
    if value is None:
      raise DocumentError(f"{path}: row {first_row + offset} has no {field!r} text (null); remove or fill that row.")
    yield value


def _missing_field(path: str, field: str, names) -> DocumentError:
  return DocumentError(f"{path} has no column {field!r} (it has {', '.join(names)}); {FIELD_FIX}.")


def parquet_documents(path: str, field: str = "text") -> Iterator[str]:
  """The `field` column of a parquet file, one row group at a time."""
  try:
    parquet = pq.ParquetFile(path)
  except (pa.ArrowException, OSError) as error:
    raise DocumentError(f"{path} is not a readable parquet file ({error}); replace the file.") from None
  if field not in parquet.schema_arrow.names:
    raise _missing_field(path, field, parquet.schema_arrow.names)
  row = 0
  for group in range(parquet.num_row_groups):
    try:
      column = parquet.read_row_group(group, columns=[field]).column(0)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as error:
      raise DocumentError(
        f"{path}: row group {group} (rows from {row}) is damaged ({error}); replace the file."
      ) from None
    yield from _text_values(path, column, row, field)
    row += len(column)


def arrow_documents(path: str, field: str = "text") -> Iterator[str]:
  """The `field` column of an Arrow stream file (a `datasets` folder's data file), one record batch at a time."""
  try:
    with pa.memory_map(path) as source:
      reader = pa.ipc.open_stream(source)
      if field not in reader.schema.names:
        raise _missing_field(path, field, reader.schema.names)
      row = 0
      for batch in reader:
        yield from _text_values(path, batch.column(field), row, field)
        row += batch.num_rows
  except (pa.ArrowException, OSError) as error:
    raise DocumentError(f"{path} is not a readable Arrow stream file ({error}); save the dataset again.") from None


def datasets_files(folder: str) -> list[str]:
  """The data files of a folder written by `datasets.Dataset.save_to_disk`, in order (its state.json)."""
  state_path = os.path.join(folder, "state.json")
  if not os.path.isfile(state_path):
    hint = (
      "it holds a DatasetDict: point at one split's folder, e.g. " + os.path.join(folder, "train")
      if os.path.isfile(os.path.join(folder, "dataset_dict.json"))
      else "write it with datasets' save_to_disk"
    )
    raise DocumentError(f"{folder} is not a folder written by save_to_disk (no state.json); {hint}.")
  try:
    with open(state_path, encoding="utf-8") as f:
      names = [entry["filename"] for entry in json.load(f)["_data_files"]]
  except (ValueError, KeyError, TypeError) as error:
    raise DocumentError(f"{state_path} is damaged ({error!r}); save the dataset again.") from None
  return [os.path.join(folder, name) for name in names]


def _frame_chunks(f, new_frame, what: str) -> Iterator[bytes]:
  """Decompressed chunks of a stream of one or more frames (zstd frames, gzip members), yielded as they come, so a
  stream cut short or damaged fails after the text before the break (gzip.GzipFile fails for a whole read;
  zstandard's stream reader ends quietly). `new_frame()`: a decompressor with .eof and .unused_data."""
  frame, inside = new_frame(), False
  while chunk := f.read(CHUNK_BYTES):
    while chunk:
      inside = True
      out = frame.decompress(chunk)
      if out:
        yield out
      chunk = b""
      if frame.eof:
        chunk, frame, inside = frame.unused_data, new_frame(), False
  if inside:
    raise EOFError(f"the {what} stream ends inside a frame")


def _chunks(path: str) -> Iterator[bytes]:
  with epath.Path(path).open("rb") as f:  # local, or a URL such as gs://bucket/file (through TensorFlow's gfile)
    if path.endswith(".zst"):
      yield from _frame_chunks(f, zstandard.ZstdDecompressor().decompressobj, "zstd")
    elif path.endswith(".gz"):
      yield from _frame_chunks(f, lambda: zlib.decompressobj(zlib.MAX_WBITS | 16), "gzip")
    else:
      while chunk := f.read(CHUNK_BYTES):
        yield chunk


def _lines(path: str) -> Iterator[tuple[int, int, bytes]]:
  """(line number, byte offset in the decompressed text, line) of a file, plain, .gz or .zst."""
  number, offset, rest = 0, 0, b""
  try:
    for chunk in _chunks(path):
      *whole, rest = (rest + chunk).split(b"\n")
      for line in whole:
        number += 1
        yield number, offset, line
        offset += len(line) + 1
  except (EOFError, OSError, zlib.error, zstandard.ZstdError) as error:
    if offset + len(rest) == 0 and ("header" in str(error) or "frame descriptor" in str(error)):
      raise DocumentError(
        f"{path} is not {'gzip' if path.endswith('.gz') else 'zstd'}-compressed, as its suffix says ({error}); "
        "compress it, or rename it without the suffix."
      ) from None
    raise DocumentError(
      f"{path}: the compressed stream breaks after byte {offset + len(rest)} of its text ({error}); the file is "
      "truncated or damaged: copy it again."
    ) from None
  if rest:
    yield number + 1, offset, rest


def jsonl_documents(path: str, field: str = "text") -> Iterator[str]:
  """The string `field` of each JSON line of a file, plain, .gz or .zst (by its suffix); blank lines are skipped."""
  for number, offset, raw in _lines(path):
    where = f"{path}: line {number} (byte {offset})"
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
      raise DocumentError(f"{where} is not UTF-8 ({error.reason}); re-encode the file as UTF-8.") from None
    if not text.strip(BLANK):
      continue
    try:
      record = json.loads(text)
    except json.JSONDecodeError as error:
      raise DocumentError(f"{where} is not JSON ({error.msg}): {text[:80]!r}; fix or remove the line.") from None
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str):
      raise DocumentError(f"{where} has no string field {field!r}; {FIELD_FIX}.")
    yield value


def text_documents(path: str, field: str = "") -> Iterator[str]:
  """The lines of a text file, plain, .gz or .zst (by its suffix), one document each; blank lines are skipped."""
  del field  # a line is the document
  for number, offset, raw in _lines(path):
    try:
      text = raw.removesuffix(b"\r").decode("utf-8")  # a CRLF line, as TensorFlow's line reader gives it
    except UnicodeDecodeError as error:
      raise DocumentError(
        f"{path}: line {number} (byte {offset}) is not UTF-8 ({error.reason}); re-encode the file as UTF-8."
      ) from None
    if text.strip(BLANK):
      yield text


READERS = {"text": text_documents, "jsonl": jsonl_documents, "parquet": parquet_documents, "datasets": arrow_documents}


def shard_documents(files: list[str], read: Callable[[str], Iterator[str]], index: int, count: int) -> Iterator[str]:
  """Shard `index` of `count` of the documents of `files`, as seqio shards a file source: whole files
  (files[index::count], each read in order) when there are at least `count` files, else every count-th document
  of all of them. The `count` shards hold every document exactly once."""
  if len(files) >= count:
    for path in files[index::count]:
      yield from read(path)
  else:
    yield from itertools.islice(itertools.chain.from_iterable(map(read, files)), index, None, count)

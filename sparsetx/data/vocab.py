"""Vocabularies: byte-level by default (no files), SentencePiece from a local model file, GPT-2 BPE from local files.

All keep id 0 for padding, which the packer relies on (it treats target 0 as padding). Byte and
SentencePiece follow seqio's ids (pad=0, eos=1, unk=2); `sparsetx/tools/build_vocab.py` trains a SentencePiece
model with these ids, or (`--kind=gpt2`) a byte-level BPE in GPT-2's file format with <pad>=0,
<|endoftext|>=1. GPT-2's own files give id 0 to "!"; sparsetx.data.bpe_vocab explains how that id moves.
"""

import hashlib

import ml_collections
import numpy as np
import seqio
import tensorflow as tf

from sparsetx import config as config_lib
from sparsetx.data import bpe_vocab


class Gpt2BpeVocabulary(seqio.Vocabulary):
  """A GPT-2 byte-level BPE from local files (see sparsetx.data.bpe_vocab for the files and ids).

  TensorFlow has no byte-level BPE op (tensorflow_text offers SentencePiece and WordPiece only), so the
  seqio task's tf.data path calls the `tokenizers` library through `tf.numpy_function`. The tokenize job
  encodes in batches instead (encoders.py).
  """

  def __init__(self, path: str, field: str = "config.data.vocab.path"):
    self._bpe = bpe_vocab.load(path, field)
    self._path = path
    self._fingerprint = hashlib.sha256(self._bpe.tokenizer.to_str().encode()).hexdigest()
    super().__init__(extra_ids=0)

  @property
  def bos_id(self) -> None:
    return None

  @property
  def eos_id(self) -> int:
    return self._bpe.eos_id

  @property
  def unk_id(self) -> None:
    return None  # byte-level: every string has an encoding

  @property
  def _base_vocab_size(self) -> int:
    return self._bpe.vocab_size

  def _encode(self, s: str) -> list[int]:
    return self._bpe.encode(s)

  def _decode(self, ids) -> str:
    return self._bpe.decode(ids)

  def _encode_np(self, text_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat ids and per-string lengths of an array of UTF-8 strings.

    One string at a time: `encode_batch` would start tokenizers' thread pool inside tf.data's threads, and a
    later fork (multi-process launchers) then disables it with a warning.
    """
    ids = [self._bpe.encode(t.decode("utf-8")) for t in np.asarray(text_N).reshape(-1)]
    lengths_N = np.array([len(i) for i in ids], np.int64)
    flat = np.fromiter((t for i in ids for t in i), np.int32, count=int(lengths_N.sum()))
    return flat, lengths_N

  def _encode_tf(self, s: tf.Tensor) -> tf.Tensor | tf.RaggedTensor:
    """A scalar string -> int32 [L]; a vector of strings -> ragged int32 [N, None]."""
    s = tf.convert_to_tensor(s, tf.string)
    if s.shape.rank not in (0, 1):
      raise ValueError(f"Gpt2BpeVocabulary.encode_tf takes a string or a vector of strings, not shape {s.shape}.")
    flat_ids, lengths = tf.numpy_function(self._encode_np, [s], (tf.int32, tf.int64), stateful=False)
    flat_ids.set_shape([None])
    if s.shape.rank == 0:
      return flat_ids
    return tf.RaggedTensor.from_row_lengths(flat_ids, tf.ensure_shape(lengths, s.shape))

  def _decode_np(self, ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids)
    rows = ids.reshape(int(np.prod(ids.shape[:-1])), ids.shape[-1])
    texts = [self._bpe.decode(row).encode("utf-8") for row in rows]
    return np.array(texts, dtype=object).reshape(ids.shape[:-1])

  def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
    """int ids [..., L] -> strings [...] (a scalar for one sequence)."""
    ids = tf.convert_to_tensor(ids)
    text = tf.numpy_function(self._decode_np, [ids], tf.string, stateful=False)
    text.set_shape(ids.shape[:-1])
    return text

  def __eq__(self, other) -> bool:
    return isinstance(other, Gpt2BpeVocabulary) and self._fingerprint == other._fingerprint

  def __hash__(self) -> int:
    return hash(self._fingerprint)

  def __repr__(self) -> str:
    return f"Gpt2BpeVocabulary(path={self._path!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def make_vocabulary(data: ml_collections.ConfigDict, model_vocab_size: int | None = None) -> seqio.Vocabulary:
  """The vocabulary named by `config.data.vocab`; refuses one larger than the model's embedding.

  Args:
    data: `config.data`.
    model_vocab_size: `config.model.vocab_size`; when given, the vocabulary must fit in it.
  """
  kind, path = data.vocab.kind, data.vocab.path
  if kind == "byte":
    vocabulary = seqio.ByteVocabulary()
  elif kind == "sentencepiece":
    if not path or not tf.io.gfile.exists(path):
      raise config_lib.ConfigError(
        f"config.data.vocab.path={path!r} is not a file; build one with python -m sparsetx.tools.build_vocab."
      )
    vocabulary = seqio.SentencePieceVocabulary(path)
    try:
      _ = vocabulary.vocab_size  # loads the model now, so a corrupt file fails here with its name
    except Exception as error:  # sentencepiece raises plain RuntimeError/OSError on a bad proto
      raise config_lib.ConfigError(
        f"config.data.vocab.path={path!r} is not a SentencePiece model ({error}); rebuild it with python -m sparsetx.tools.build_vocab."
      ) from error
  elif kind == "gpt2":
    vocabulary = Gpt2BpeVocabulary(path)
  else:
    raise config_lib.ConfigError(
      f"config.data.vocab.kind={kind!r} is unknown; use one of {', '.join(map(repr, config_lib.DATA_VOCAB_KINDS))}."
    )
  if model_vocab_size is not None and vocabulary.vocab_size > model_vocab_size:
    raise config_lib.ConfigError(
      f"config.data.vocab ({kind}, {vocabulary.vocab_size} ids) is larger than "
      f"config.model.vocab_size={model_vocab_size}; raise config.model.vocab_size to at least "
      f"{vocabulary.vocab_size} or use a smaller vocabulary."
    )
  return vocabulary

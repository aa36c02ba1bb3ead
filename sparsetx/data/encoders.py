"""Batch encoding in each vocabulary's native library: what the tokenize job runs on a batch of documents.

seqio tokenizes one document per tf.data step. A corpus job encodes a whole batch in the tokenizer's own code
instead: the Rust `tokenizers` library's `encode_batch` (GPT-2 BPE, on its thread pool), SentencePiece's C++
batch encode (threads), NumPy for bytes. Each gives the ids seqio's vocabulary gives the same text, plus EOS.
"""

import itertools
import os
from collections.abc import Callable

import numpy as np
import seqio

BatchEncoder = Callable[[list[str]], list[np.ndarray]]


def _split(flat_ids: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
  return np.split(flat_ids, np.cumsum(lengths, dtype=np.int64)[:-1]) if lengths else []


def _with_eos(ids_per_document: list[list[int]], eos_id: int) -> list[np.ndarray]:
  lengths = [len(ids) for ids in ids_per_document]
  flat = np.fromiter(itertools.chain.from_iterable(ids_per_document), np.int32, count=sum(lengths))
  flat = np.insert(flat, np.cumsum(lengths, dtype=np.int64), eos_id)
  return _split(flat, [n + 1 for n in lengths])


def _byte_encoder(vocabulary: seqio.ByteVocabulary) -> BatchEncoder:
  offset, eos_id = vocabulary._num_special_tokens, vocabulary.eos_id  # seqio: byte b is id b + 3

  def encode(texts: list[str]) -> list[np.ndarray]:
    encoded = [text.encode("utf-8") + b"\0" for text in texts]  # "\0" marks each EOS
    ids = np.frombuffer(b"".join(encoded), np.uint8).astype(np.int32) + offset
    ids[np.cumsum([len(e) for e in encoded], dtype=np.int64) - 1] = eos_id
    return _split(ids, [len(e) for e in encoded])

  return encode


def _sentencepiece_encoder(vocabulary: seqio.SentencePieceVocabulary) -> BatchEncoder:
  processor, eos_id = vocabulary.tokenizer, vocabulary.eos_id
  threads = len(os.sched_getaffinity(0))

  def encode(texts: list[str]) -> list[np.ndarray]:
    return _with_eos(processor.encode(texts, out_type=int, num_threads=threads), eos_id)

  return encode


def _gpt2_encoder(vocabulary) -> BatchEncoder:
  bpe = vocabulary._bpe

  def encode(texts: list[str]) -> list[np.ndarray]:
    encodings = bpe.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    documents = _with_eos([e.ids for e in encodings], bpe.eos_id)
    if bpe.moved_id is not None:  # the files' id 0 is the model's padding: it moved (bpe_vocab)
      documents = [np.where(ids == 0, bpe.moved_id, ids).astype(np.int32) for ids in documents]
    return documents

  return encode


def batch_encoder(vocabulary: seqio.Vocabulary) -> BatchEncoder:
  """texts -> each text's ids followed by EOS (int32), as `vocabulary.encode` gives them."""
  from sparsetx.data import vocab  # its Gpt2BpeVocabulary

  if isinstance(vocabulary, seqio.ByteVocabulary):
    return _byte_encoder(vocabulary)
  if isinstance(vocabulary, seqio.SentencePieceVocabulary):
    return _sentencepiece_encoder(vocabulary)
  if isinstance(vocabulary, vocab.Gpt2BpeVocabulary):
    return _gpt2_encoder(vocabulary)
  raise TypeError(f"no batch encoder for {type(vocabulary).__name__}")

"""The token store: documents round-trip, rows equal slices of the concatenated documents with their
boundaries, and a missing, incomplete or damaged shard is one clear error naming it."""

import numpy as np
import pytest

from sparsetx.data import token_store


def _documents(rng, n, vocab_size=300, eos=1):
  return [np.append(rng.integers(3, vocab_size, rng.integers(1, 40)), eos) for _ in range(n)]


def _write_corpus(tmp_path, shards_docs, vocab_size=300):
  directory = token_store.split_dir(tmp_path, "web", "train")
  for i, docs in enumerate(shards_docs):
    token_store.write_shard(directory / token_store.shard_name(i, len(shards_docs)), docs, vocab_size)
  token_store.write_manifest(tmp_path, {"kind": "byte"}, {"web": {"train": len(shards_docs)}})
  return token_store.TokenSplit(tmp_path, "web", "train")


def test_documents_round_trip(tmp_path):
  rng = np.random.default_rng(0)
  docs = _documents(rng, 2500)  # more documents than one sample stride of the end index
  token_store.write_shard(tmp_path / "s", docs, 300)
  shard = token_store.Shard(tmp_path / "s")
  assert shard.n_documents == len(docs) and shard.n_tokens == sum(d.size for d in docs)
  assert all(np.array_equal(a, b) for a, b in zip(shard.documents(), docs, strict=True))
  shard.verify()


def test_rows_are_slices_with_document_starts(tmp_path):
  rng = np.random.default_rng(1)
  shards_docs = [_documents(rng, 1500), _documents(rng, 7)]
  split = _write_corpus(tmp_path, shards_docs)
  seq_len = 16
  reference_tokens, reference_starts = [], []
  for docs in shards_docs:  # per shard: whole rows of the concatenation, a start at offset 0 of every document
    flat = np.concatenate(docs)
    begins = np.zeros(flat.size, bool)
    begins[np.cumsum([0] + [d.size for d in docs[:-1]])] = True
    for r in range(flat.size // seq_len):
      reference_tokens.append(flat[r * seq_len : (r + 1) * seq_len])
      row_begins = begins[r * seq_len : (r + 1) * seq_len].copy()
      row_begins[0] = True
      reference_starts.append(row_begins)
  assert split.row_count(seq_len) == len(reference_tokens)
  ids = rng.permutation(len(reference_tokens))[:200]
  ids = np.append(ids, [len(reference_tokens) - 1, 0, 0])
  rows = split.rows(ids, seq_len)
  np.testing.assert_array_equal(rows.tokens_NT, np.stack(reference_tokens)[ids])
  np.testing.assert_array_equal(rows.starts_NT, np.stack(reference_starts)[ids])
  with pytest.raises(IndexError):
    split.rows([len(reference_tokens)], seq_len)


def test_missing_and_incomplete_shards_are_named(tmp_path):
  rng = np.random.default_rng(2)
  _write_corpus(tmp_path, [_documents(rng, 5), _documents(rng, 5)])
  second = token_store.split_dir(tmp_path, "web", "train") / token_store.shard_name(1, 2)
  (second / token_store.SHARD_JSON).unlink()
  assert not token_store.shard_complete(second)
  with pytest.raises(token_store.CorpusError, match=f"shard {second} is missing or incomplete"):
    token_store.TokenSplit(tmp_path, "web", "train")
  with pytest.raises(token_store.CorpusError, match="has no split 'validation' of task 'web'"):
    token_store.TokenSplit(tmp_path, "web", "validation")
  with pytest.raises(token_store.CorpusError, match="is not a finished tokenized corpus"):
    token_store.TokenSplit(tmp_path / "elsewhere", "web", "train")


def test_damaged_shard_is_named(tmp_path):
  rng = np.random.default_rng(3)
  split = _write_corpus(tmp_path, [_documents(rng, 50)])
  shard = split.shards[0]
  shard.verify()
  chunk = shard.path / "tokens" / "c" / "0"
  chunk.write_bytes(chunk.read_bytes()[:-7])  # a torn write
  with pytest.raises(token_store.CorpusError, match=f"shard {shard.path} is damaged"):
    token_store.Shard(shard.path).verify()
  with pytest.raises(token_store.CorpusError, match=f"shard {shard.path} is damaged"):
    token_store.TokenSplit(tmp_path, "web", "train").rows([0], 8)
  with pytest.raises(ValueError, match="outside"):
    token_store.write_shard(tmp_path / "t", [np.array([5, 300])], 300)

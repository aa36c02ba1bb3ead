"""The input pipeline: mixture rates, lossless packing, disjoint shards, exact resume, global batches, eval."""

import collections
import json
import math
import os

import jax
import ml_collections
import numpy as np
import pytest
import seqio
import tensorflow as tf
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparsetx import config as config_lib
from sparsetx.data import check_files, corpus, pipeline, tasks, vocab

SEQ_LEN = 64
BYTES = seqio.ByteVocabulary()


def document(name: str, i: int, n: int) -> str:
  """Unique text whose every SEQ_LEN piece names its document, so pieces never repeat."""
  text = f"{name} {i:04d} " + (f"{i:04d}." * 60)[:n]
  return text + "!" if (len(text) + 1) % SEQ_LEN == 1 else text  # no piece is a lone EOS


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """alpha: 4 text files (sharded by file); beta: 1 text file (sharded by example); gamma: JSONL."""
  root = tmp_path_factory.mktemp("text")
  rng = np.random.default_rng(0)
  alpha = [document("alpha", i, int(rng.integers(0, 150))) for i in range(400)]
  for part in range(4):
    (root / f"alpha-{part}.txt").write_text("\n".join(alpha[part::4]) + "\n\n")  # a blank line is skipped
  beta = [document("beta", i, int(rng.integers(0, 40))) for i in range(300)]
  (root / "beta.txt").write_text("\n".join(beta) + "\n")
  gamma = [document("gamma", i, int(rng.integers(0, 90))) for i in range(200)]
  (root / "gamma.jsonl").write_text("\n".join(json.dumps({"id": i, "text": t}) for i, t in enumerate(gamma)) + "\n")
  return dict(root=root, alpha=alpha, beta=beta, gamma=gamma)


def make_config(files, mixture, **data) -> ml_collections.ConfigDict:
  config = config_lib.default_config()
  root = files["root"]
  config.data.sources.alpha = ml_collections.ConfigDict(
    dict(kind="text", train=str(root / "alpha-*.txt"), validation=str(root / "alpha-*.txt"))
  )
  config.data.sources.beta = ml_collections.ConfigDict(dict(kind="text", train=str(root / "beta.txt")))
  config.data.sources.gamma = ml_collections.ConfigDict(
    dict(kind="jsonl", train=str(root / "gamma.jsonl"), text_field="text")
  )
  config.data.update(dict(mixture=mixture, seq_len=SEQ_LEN, global_batch_size=8, eval_batch_size=8, shuffle_buffer=64))
  config.data.update(data)
  return check_files(config_lib.validate(config))


@pytest.fixture(scope="module")
def sharding():
  mesh = Mesh(np.array(jax.devices()), ("data",))
  return NamedSharding(mesh, P("data", None))


def pieces(text: str, length: int = SEQ_LEN) -> list[tuple[int, ...]]:
  """What the pipeline must deliver for one document: its bytes + EOS, cut every `length` tokens."""
  ids = BYTES.encode(text) + [BYTES.eos_id]
  return [tuple(ids[i : i + length]) for i in range(0, len(ids), length)]


def segments(batch) -> list[tuple[int, ...]]:
  """The token pieces of every packed row of a (local, numpy) batch."""
  out = []
  for targets, segment_ids in zip(np.asarray(batch["targets"]), np.asarray(batch["segment_ids"])):
    for s in range(1, segment_ids.max() + 1):
      out.append(tuple(targets[segment_ids == s].tolist()))
  return out


def check_row_structure(batch):
  """Segments are contiguous and numbered 1..k, positions restart per segment, inputs are shifted targets."""
  arrays = {k: np.asarray(v) for k, v in batch.items()}
  for row in range(arrays["targets"].shape[0]):
    targets, inputs = arrays["targets"][row], arrays["inputs"][row]
    seg, pos, weights = arrays["segment_ids"][row], arrays["positions"][row], arrays["loss_weights"][row]
    real = targets != 0
    np.testing.assert_array_equal(weights, real.astype(np.float32))
    assert (seg[~real] == 0).all() and (pos[~real] == 0).all() and (inputs[~real] == 0).all()
    n = int(real.sum())
    assert real[:n].all()  # padding only at the end
    starts = np.flatnonzero(np.diff(np.concatenate([[0], seg[:n]])) != 0)
    assert list(seg[starts]) == list(range(1, len(starts) + 1))
    for begin, end in zip(starts, list(starts[1:]) + [n]):
      np.testing.assert_array_equal(pos[begin:end], np.arange(end - begin))
      assert inputs[begin] == 0
      np.testing.assert_array_equal(inputs[begin + 1 : end], targets[begin : end - 1])


def test_mixture_draws_from_its_tasks_at_the_configured_rates(files):
  config = make_config(files, (("alpha", 0.7), ("beta", 0.3)), seq_len=256)  # no document is split
  mixture = tasks.register_mixture(config.data, vocab.make_vocabulary(config.data))
  dataset = mixture.get_dataset({"targets": 256}, split="train", shuffle=True, seed=3, num_epochs=None)
  n = 3000
  first_bytes = next(dataset.map(lambda ex: ex["targets"][0]).batch(n).as_numpy_iterator())
  counts = collections.Counter(BYTES.decode([int(b)]) for b in first_bytes)
  assert set(counts) == {"a", "b"}
  tolerance = 4 * math.sqrt(0.7 * 0.3 / n)  # 4 sigma of a binomial proportion
  assert abs(counts["a"] / n - 0.7) < tolerance, counts


def test_packing_loses_and_duplicates_no_token(files, sharding):
  config = make_config(files, (("alpha", 1.0),))
  tasks.register_mixture(config.data, vocab.make_vocabulary(config.data, config.model.vocab_size))
  batches = pipeline.local_eval_batches(config, "alpha", "validation", seqio.ShardInfo(0, 1), 8)
  expected = [p for text in files["alpha"] for p in pieces(text)]
  assert max(map(len, expected)) == SEQ_LEN and len(expected) > len(files["alpha"])  # some documents were split
  packed = [s for batch in batches for s in segments(batch)]
  assert collections.Counter(packed) == collections.Counter(expected)
  rows = sum(batch["targets"].shape[0] for batch in batches)
  assert rows < len(expected) and max(b["segment_ids"].max() for b in batches) >= 2  # rows are shared
  for batch in batches:
    check_row_structure(batch)


@pytest.fixture
def train_iterator(files, sharding):
  """A fresh iterator over alpha (text, 4 files) and gamma (JSONL) per test: no test sees another's reads."""
  return pipeline.make_train_iterator(make_config(files, (("alpha", 0.5), ("gamma", 0.5))), sharding)


def test_train_rows_are_packed_documents(files, train_iterator):
  iterator = train_iterator
  documents = {p for text in files["alpha"] + files["gamma"] for p in pieces(text)}
  for _ in range(3):
    batch = next(iterator)
    check_row_structure(batch)
    assert set(segments(batch)) <= documents


@pytest.mark.parametrize("task", ["alpha", "beta"])  # sharded by file, by example
def test_two_processes_read_disjoint_examples_whose_union_is_one_process(files, task):
  config = make_config(files, ((task, 1.0),), seq_len=256)  # whole documents: every example is unique
  tasks.register_mixture(config.data, vocab.make_vocabulary(config.data))
  seqio_task = seqio.get_mixture_or_task(tasks.task_name(task))

  def read(index, count):
    dataset = seqio_task.get_dataset(
      {"targets": 256}, split="train", shuffle=True, seed=1, shard_info=seqio.ShardInfo(index, count), num_epochs=1
    )
    return [tuple(ex["targets"].tolist()) for ex in dataset.as_numpy_iterator()]

  first, second, whole = read(0, 2), read(1, 2), read(0, 1)
  assert first and second and not set(first) & set(second)
  assert collections.Counter(first + second) == collections.Counter(whole)
  assert collections.Counter(whole) == collections.Counter(p for text in files[task] for p in pieces(text, 256))


def test_sharded_packed_eval_batches_partition_the_split(files):
  config = make_config(files, (("alpha", 1.0),), seq_len=256)
  tasks.register_mixture(config.data, vocab.make_vocabulary(config.data, config.model.vocab_size))
  read = lambda index, count, rows: [  # noqa: E731
    s
    for b in pipeline.local_eval_batches(config, "alpha", "validation", seqio.ShardInfo(index, count), rows)
    for s in segments(b)
  ]
  first, second = read(0, 2, 4), read(1, 2, 4)
  assert not set(first) & set(second)
  assert collections.Counter(first + second) == collections.Counter(read(0, 1, 8))


def _stream(iterator, n):
  return [iterator.next_local() for _ in range(n)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_save_and_restore_continue_the_identical_stream(files, sharding, tmp_path):
  config = make_config(files, (("stories", 0.5), ("gamma", 0.3), ("alpha", 0.2)))
  uninterrupted = pipeline.make_train_iterator(config, sharding)
  _stream(uninterrupted, 7)
  state_dir = uninterrupted.save(str(tmp_path / "step7"))
  assert sorted(os.listdir(state_dir))[-1] == "iterator.index" or "data_state.json" in os.listdir(state_dir)
  expected = _stream(uninterrupted, 5)

  resumed = pipeline.make_train_iterator(config, sharding)
  resumed.restore(str(tmp_path / "step7"))
  assert resumed.steps == 7
  _assert_same(_stream(resumed, 5), expected)
  assert resumed.steps == 12

  # The state holds positions and buffers, not the data consumed: it does not grow with steps.
  _stream(uninterrupted, 30)
  later_dir = uninterrupted.save(str(tmp_path / "step42"))
  size = lambda d: sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))  # noqa: E731
  assert size(later_dir) < 2 * size(state_dir)


def test_text_and_jsonl_resume_is_bit_identical_after_rewinding(files, sharding, tmp_path):
  """Regression: a restore into the iterator that saved (after it read on) rewound to another file order.

  Saved before the file shuffle's iterator exists, the state does not hold that shuffle's seed
  generator, which lives in the dataset and had advanced; restore must start from a fresh dataset.
  """
  config = make_config(files, (("alpha", 0.5), ("gamma", 0.5)))
  iterator = pipeline.make_train_iterator(config, sharding)
  expected = {}
  for consumed in (0, 2, 5):  # states at 0, 2 and 5 batches, each followed by 2 batches
    _stream(iterator, consumed - iterator.steps)
    iterator.save(str(tmp_path / f"step{consumed}"))
    expected[consumed] = _stream(iterator, 2)
  for consumed in (5, 0):  # rewind the same object, already read past the state
    iterator.restore(str(tmp_path / f"step{consumed}"))
    _assert_same(_stream(iterator, 2), expected[consumed])
    assert iterator.steps == consumed + 2
  # (Restoring a freshly built iterator, as the trainer does: test_save_and_restore_continue_the_identical_stream.)


def test_restore_refuses_another_data_config_or_a_missing_state(files, sharding, train_iterator, tmp_path):
  train_iterator.save(str(tmp_path / "state"))
  other = pipeline.make_train_iterator(make_config(files, (("alpha", 0.5), ("gamma", 0.5)), seed=5), sharding)
  with pytest.raises(config_lib.ConfigError, match=r"config\.data\.seed=0, but the config now has 5"):
    other.restore(str(tmp_path / "state"))
  with pytest.raises(ValueError, match="no data state for shard 0 of 1"):
    train_iterator.restore(str(tmp_path / "nothing"))


def test_global_batch_is_one_sharded_array_per_feature(sharding, train_iterator, tmp_path):
  assert pipeline.data_shard(sharding, 8) == (seqio.ShardInfo(0, 1), 8)
  replicated = NamedSharding(sharding.mesh, P(None, None))
  assert pipeline.data_shard(replicated, 8) == (seqio.ShardInfo(0, 1), 8)
  train_iterator.next_local()  # save after a read too, not only at the start of the stream
  train_iterator.save(str(tmp_path / "before"))
  local = train_iterator.next_local()
  train_iterator.restore(str(tmp_path / "before"))  # rewinds: the same rows again, now as global arrays
  batch = next(train_iterator)
  assert set(batch) == set(pipeline.FEATURES)
  for k, array in batch.items():
    assert isinstance(array, jax.Array) and array.shape == (8, SEQ_LEN) and array.sharding == sharding
    assert array.dtype == (np.float32 if k == "loss_weights" else np.int32)
    assert {s.data.shape for s in array.addressable_shards} == {(1, SEQ_LEN)}
    np.testing.assert_array_equal(np.asarray(array), local[k])


def test_eval_reads_each_validation_split_once_with_a_padded_last_batch(sharding):
  config = config_lib.default_config()
  config.data.eval_batch_size = 16
  eval_data = pipeline.EvalData(config, sharding)
  assert eval_data.task_names == ["stories", "facts"]
  facts = [s for b in eval_data.batches["facts"] for s in segments(b)]
  assert sorted(facts) == sorted(p for text in corpus.fact_documents("validation") for p in pieces(text, 256))
  stories = [s for b in eval_data.batches["stories"] for s in segments(b)]
  assert collections.Counter(stories) == collections.Counter(
    p for text in corpus.stories("validation") for p in pieces(text, 256)
  )
  last = eval_data.batches["stories"][-1]
  padded = last["targets"].max(axis=1) == 0
  assert padded.any() and (last["loss_weights"][padded] == 0).all() and (last["segment_ids"][padded] == 0).all()
  batches = list(eval_data)
  assert len(batches) == sum(map(len, eval_data.batches.values()))
  assert all(b["targets"].shape == (16, 256) and b["targets"].sharding == sharding for b in batches)
  again = pipeline.EvalData(config, sharding)  # deterministic: rebuilt, the same batches
  _assert_same(again.batches["stories"], eval_data.batches["stories"])


def test_eval_without_any_validation_split_is_an_error(files, sharding):
  config = make_config(files, (("beta", 1.0),))
  with pytest.raises(config_lib.ConfigError, match="no task of config.data.mixture has a 'validation' split"):
    pipeline.make_eval_iterator(config, sharding)


def test_tfrecord_source_unpacked_rows_hold_one_piece_each(files, tmp_path):
  texts = files["beta"][:50]
  path = tmp_path / "beta.tfrecord"
  with tf.io.TFRecordWriter(str(path)) as writer:
    for text in texts:
      feature = {"body": tf.train.Feature(bytes_list=tf.train.BytesList(value=[text.encode()]))}
      writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
  config = make_config(files, (("alpha", 1.0),), pack=False)
  config.data.mixture = (("records", 1.0),)
  config.data.sources.records = ml_collections.ConfigDict(
    dict(kind="tfrecord", train=str(path), validation=str(path), text_field="body")
  )
  check_files(config_lib.validate(config))
  tasks.register_mixture(config.data, vocab.make_vocabulary(config.data))
  batches = pipeline.local_eval_batches(config, "records", "validation", seqio.ShardInfo(0, 1), 8)
  assert collections.Counter(s for b in batches for s in segments(b)) == collections.Counter(
    p for text in texts for p in pieces(text)
  )
  for batch in batches:
    check_row_structure(batch)
    assert batch["segment_ids"].max() <= 1

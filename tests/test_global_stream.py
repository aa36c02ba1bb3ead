"""The deterministic global stream: a batch does not depend on how many processes read it, the mixture keeps its
rates within one row, the row permutations are bijections, rows are the corpus's, a changed stream is refused on
restore (or continued with accept_new_stream), and tokenized evaluation goes once over each validation split."""

import json

import jax
import numpy as np
import pytest
from conftest import load_config

from sparsetx import config as config_lib
from sparsetx.data import global_stream, packing, token_store
from sparsetx.data.batches import FEATURES
from sparsetx.parallel import mesh as mesh_lib


class Block:
  """A batch sharding as process `index` of `count` sees it: one contiguous block of the rows."""

  def __init__(self, index, count):
    self.index, self.count = index, count

  def addressable_devices_indices_map(self, shape):
    rows = shape[0] // self.count
    return {"device": (slice(self.index * rows, (self.index + 1) * rows),)}


def _config(corpus, **data):
  config = load_config("configs/tiny.py")
  config.data.update(dict(tokenized_dir=str(corpus), seq_len=32, global_batch_size=8, eval_batch_size=8), **data)
  return config


@pytest.mark.parametrize("size", [1, 2, 3, 5, 64, 1000, 4097])
def test_permutation_is_a_bijection(size):
  values = global_stream.Permutation(size, key=7)(np.arange(size))
  np.testing.assert_array_equal(np.sort(values), np.arange(size))
  if size >= 64:  # keyed: another key gives another order
    assert not np.array_equal(values, global_stream.Permutation(size, key=8)(np.arange(size)))


def test_permutation_of_a_huge_split_stays_in_range_without_collisions():
  size = 3 * 10**8 + 7
  values = global_stream.Permutation(size, key=1)(np.arange(10**5) * 2999)
  assert values.min() >= 0 and values.max() < size and np.unique(values).size == values.size


@pytest.mark.parametrize(
  "rates,batch", [((0.7, 0.3), 8), ((0.5, 0.3, 0.2), 16), ((0.9, 0.09, 0.007, 0.003), 16), ((1, 1, 1), 1)]
)
def test_mixture_counts_stay_within_one_row_of_the_rates_and_never_drop(rates, batch):
  apportionment = global_stream.Apportionment(rates)
  group = apportionment.group_steps(batch)
  share = np.array(rates) / sum(rates)
  previous = np.zeros(len(rates))
  for g in range(1, 3000):
    n = g * group * batch
    counts = np.array(apportionment.counts(n))
    assert counts.sum() == n and (counts >= previous).all()
    assert np.abs(counts - n * share).max() < 1, (g, counts, n * share)
    previous = counts


def test_the_batch_does_not_depend_on_the_process_count(tokenized_corpus):
  config = _config(tokenized_corpus)
  whole = global_stream.GlobalStream(config, Block(0, 1))
  batches = [whole.next_local() for _ in range(6)]
  for count in (2, 4):
    parts = [global_stream.GlobalStream(config, Block(i, count)) for i in range(count)]
    for step in range(6):
      local = [part.next_local() for part in parts]
      for k in FEATURES:
        np.testing.assert_array_equal(np.concatenate([part[k] for part in local]), batches[step][k])
    for part in parts:
      part.close()
  # A stream started at step 3 (a resume) continues with the same batches.
  resumed = global_stream.GlobalStream(config, Block(0, 1), step=3)
  np.testing.assert_array_equal(resumed.next_local()["targets"], batches[3]["targets"])
  # Every row is the corpus's row, packed; the mixture's 0.7 / 0.3 gives 5.6 / 2.4 rows per step.
  splits = {name: token_store.TokenSplit(tokenized_corpus, name, "train") for name in ("stories", "facts")}
  per_task = np.zeros(2, int)
  for step, batch in enumerate(batches):
    task_B, row_B = whole.batch_rows(step)
    per_task += np.bincount(task_B, minlength=2)
    for b, (t, r) in enumerate(zip(task_B, row_B)):
      rows = splits[whole.tasks[t]].rows([r], 32)
      for k, v in packing.packed_features(rows).items():
        np.testing.assert_array_equal(batch[k][b], v[0])
  assert np.abs(per_task - 6 * 8 * np.array([0.7, 0.3])).max() < 1
  whole.close()
  resumed.close()


def test_global_batches_on_a_mesh(tokenized_corpus):
  config = _config(tokenized_corpus)
  config.mesh.ici.data = 8
  mesh = mesh_lib.make_mesh(config.mesh)
  stream = global_stream.GlobalStream(config, mesh_lib.batch_sharding(mesh, config.mesh.rules))
  reference = global_stream.GlobalStream(config, Block(0, 1))
  for _ in range(2):
    batch, expected = next(stream), reference.next_local()
    assert batch["targets"].shape == (8, 32) and len(batch["targets"].sharding.device_set) == 8
    for k in FEATURES:
      np.testing.assert_array_equal(jax.device_get(batch[k]), expected[k])
  stream.close()
  reference.close()


def test_every_row_of_an_epoch_is_read_once(tmp_path):
  from conftest import write_tokenized_corpus

  rng = np.random.default_rng(0)
  texts = ["".join(rng.choice(list("abcdefgh"), rng.integers(5, 40))) for _ in range(60)]
  corpus = write_tokenized_corpus(tmp_path, {"stories": {"train": texts}}, shards=3)
  config = _config(corpus, mixture=(("stories", 1.0),), seq_len=8, global_batch_size=4)
  stream = global_stream.GlobalStream(config, Block(0, 1))
  rows = stream.row_counts[0]
  seen = np.concatenate([stream.batch_rows(step)[1] for step in range(rows)])  # 4 epochs of 4-row steps
  np.testing.assert_array_equal(np.bincount(seen, minlength=rows), np.full(rows, 4))  # each row once per epoch
  assert len({tuple(stream._row_permutation(0, e)(np.arange(rows))) for e in range(4)}) == 4  # a new order each
  stream.close()


def test_a_changed_stream_is_refused_on_restore_unless_accepted(tokenized_corpus):
  stream = global_stream.GlobalStream(_config(tokenized_corpus), Block(0, 1), step=5)
  state = json.loads(json.dumps(stream.state()))  # what the checkpoint item holds
  assert global_stream.check_state(state)["step"] == 5
  same = global_stream.GlobalStream(_config(tokenized_corpus), Block(0, 1))
  same.restore(state, "step 5")
  assert same.step == 5
  changed = global_stream.GlobalStream(_config(tokenized_corpus, seed=1), Block(0, 1))
  with pytest.raises(config_lib.ConfigError, match=r"saved with config.data.seed=0 \(now 1\); .*accept_new_stream"):
    changed.restore(state, "step 5")
  accepted = global_stream.GlobalStream(_config(tokenized_corpus, seed=1, accept_new_stream=True), Block(0, 1))
  accepted.restore(state, "step 5")
  assert accepted.step == 5
  for bad, problem in (
    ([1], "not a JSON object"),
    (dict(state, format=0), "format 0"),
    (dict(state, step="x"), "no integer step"),
    (dict(state, fields=None), "fingerprint or fields"),
  ):
    with pytest.raises(ValueError, match=problem):
      global_stream.check_state(bad)
  for s in (stream, same, changed, accepted):
    s.close()


def test_a_corpus_of_another_vocabulary_is_refused(tokenized_corpus):
  manifest = token_store.read_manifest(tokenized_corpus)
  manifest["vocabulary"] = dict(manifest["vocabulary"], kind="gpt2", path="/data/bpe", vocab_size=50258)
  with pytest.raises(config_lib.ConfigError, match=r"was tokenized with vocabulary .*gpt2.* but config.data.vocab"):
    global_stream.check_vocabulary(_config(tokenized_corpus), manifest, str(tokenized_corpus))


def test_tokenized_evaluation_is_one_ordered_pass_padded_alike_on_every_process(tokenized_corpus):
  config = _config(tokenized_corpus, eval_batch_size=16)
  whole = global_stream.TokenizedEvalData(config, Block(0, 1))
  assert whole.task_names == ["stories", "facts"]
  split = token_store.TokenSplit(tokenized_corpus, "facts", "validation")
  count = split.row_count(32)
  batches = [whole.local_batch("facts", i) for i in range(-(-count // 16))]
  expected = packing.packed_features(split.rows(np.arange(count), 32))
  for k in FEATURES:
    got = np.concatenate([b[k] for b in batches])
    np.testing.assert_array_equal(got[:count], expected[k])
    assert not got[count:].any()  # padding: loss weight 0
  halves = [global_stream.TokenizedEvalData(config, Block(i, 2)) for i in range(2)]
  for i, batch in enumerate(batches):
    parts = [half.local_batch("facts", i) for half in halves]
    np.testing.assert_array_equal(np.concatenate([p["targets"] for p in parts]), batch["targets"])


def test_the_stream_state_is_an_item_of_the_checkpoint_step_read_on_any_process_count(tokenized_corpus, tmp_path):
  from sparsetx.train.checkpoints import checkpointing

  config = _config(tokenized_corpus)
  config.checkpoint.update(async_save=False)
  stream = global_stream.GlobalStream(config, Block(0, 1), step=3)
  checkpointer = checkpointing.Checkpointer(str(tmp_path), config.checkpoint)
  checkpointer.save(3, {"w": np.ones(2, np.float32)}, config, stream.state())
  checkpointer.wait()
  assert checkpointer.resume_step() == 3  # verified with its data state
  other = global_stream.GlobalStream(config, Block(1, 4))  # another process count
  other.restore(checkpointer.data_state(3), "step 3")
  assert other.step == 3
  np.testing.assert_array_equal(other.next_local()["targets"], stream.read_rows(3, 2, 2)["targets"])
  item = tmp_path / "checkpoints" / "3" / "data" / "metadata"
  item.write_text(item.read_text()[:20])
  with pytest.raises(checkpointing.CheckpointError, match=r"step 3 .*its data state is unreadable"):
    checkpointer.resume_step()
  item.write_text(json.dumps(dict(stream.state(), format=7)))
  with pytest.raises(checkpointing.CheckpointError, match=r"step 3 .*its data state has format 7"):
    checkpointer.resume_step()
  (tmp_path / "checkpoints" / "3" / "data").rename(tmp_path / "set_aside")
  with pytest.raises(checkpointing.CheckpointError, match=r"step 3 .*its 'data' item .*is missing"):
    checkpointer.resume_step()
  checkpointer.close()
  for s in (stream, other):
    s.close()


def test_a_run_of_the_older_data_state_layout_is_told_to_start_over(tmp_path):
  from sparsetx.train.run import loop

  (tmp_path / "data_state" / "10").mkdir(parents=True)
  with pytest.raises(config_lib.ConfigError, match=r"started by an older sparsetx .*start over with a new --workdir"):
    loop.train(load_config("configs/tiny.py"), str(tmp_path))


def test_a_ladder_rung_on_a_target_trains_only_from_a_tokenized_corpus(tmp_path):
  from sparsetx.train.run import loop

  config = load_config("configs/ladder.py", "sgatlin,5,h100x8")
  assert config.data.require_tokenized and not load_config("configs/ladder.py", "sgatlin,5").data.require_tokenized
  with pytest.raises(config_lib.ConfigError, match=r"write one with sparsetx-tokenize .*--config.data.tokenized_dir"):
    loop.train(config, str(tmp_path))

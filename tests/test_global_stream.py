"""The deterministic global stream: a batch does not depend on how many processes read it, the mixture keeps its
rates within one row, the row permutations are bijections, rows are the corpus's, a changed stream is refused on
restore (or continued with accept_new_stream), and tokenized evaluation goes once over each validation split."""

import json
import types

import jax
import numpy as np
import pytest
from conftest import RecordingCheckpointer, load_config

from sparsetx import config as config_lib
from sparsetx.data import global_stream, packing, pipeline, token_store
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
      for k in pipeline.FEATURES:
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
    for k in pipeline.FEATURES:
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


def test_a_changed_stream_is_refused_on_restore_unless_accepted(tokenized_corpus, tmp_path):
  stream = global_stream.GlobalStream(_config(tokenized_corpus), Block(0, 1), step=5)
  stream.save(tmp_path / "5")
  assert json.loads((tmp_path / "5" / global_stream.STATE_JSON).read_text())["step"] == 5
  same = global_stream.GlobalStream(_config(tokenized_corpus), Block(0, 1))
  same.restore(tmp_path / "5")
  assert same.step == 5
  changed = global_stream.GlobalStream(_config(tokenized_corpus, seed=1), Block(0, 1))
  with pytest.raises(config_lib.ConfigError, match=r"saved with config.data.seed=0 \(now 1\); .*accept_new_stream"):
    changed.restore(tmp_path / "5")
  accepted = global_stream.GlobalStream(_config(tokenized_corpus, seed=1, accept_new_stream=True), Block(0, 1))
  accepted.restore(tmp_path / "5")
  assert accepted.step == 5
  (tmp_path / "5" / global_stream.STATE_JSON).write_text('{"format": 1, "step": "x"')
  with pytest.raises(ValueError, match=r"its data state file .*stream_state.json is unreadable"):
    global_stream.read_state(tmp_path / "5")
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
  for k in pipeline.FEATURES:
    got = np.concatenate([b[k] for b in batches])
    np.testing.assert_array_equal(got[:count], expected[k])
    assert not got[count:].any()  # padding: loss weight 0
  halves = [global_stream.TokenizedEvalData(config, Block(i, 2)) for i in range(2)]
  for i, batch in enumerate(batches):
    parts = [half.local_batch("facts", i) for half in halves]
    np.testing.assert_array_equal(np.concatenate([p["targets"] for p in parts]), batch["targets"])


def test_the_loop_restores_the_stream_and_refuses_a_changed_one(tokenized_corpus, tmp_path):
  from sparsetx.train import loop

  global_stream.GlobalStream(_config(tokenized_corpus), Block(0, 1), step=6).save(tmp_path / "6")
  stream = global_stream.GlobalStream(_config(tokenized_corpus), Block(1, 4))  # another process count
  checkpointer = RecordingCheckpointer(tmp_path)
  loop.restore(checkpointer, 6, None, stream)
  assert stream.step == 6 and checkpointer.calls == [("model", 6)]
  other = global_stream.GlobalStream(_config(tokenized_corpus, global_batch_size=16), Block(0, 1))
  with pytest.raises(config_lib.ConfigError, match=r"config.data.global_batch_size=8 \(now 16\)"):
    loop.restore(checkpointer, 6, None, other)
  on_the_fly = types.SimpleNamespace(shard_info=None)  # the seqio pipeline cannot continue the tokenized stream
  with pytest.raises(config_lib.ConfigError, match=r"saved by the tokenized stream .*accept_new_stream=True"):
    loop.restore(checkpointer, 6, None, on_the_fly)
  loop.restore(checkpointer, 6, None, on_the_fly, accept_new_stream=True)
  assert checkpointer.calls[-1] == ("model", 6)
  # A state the on-the-fly pipeline saved (no stream state): another stream, refused unless accepted.
  (tmp_path / "8" / "shard_00000_of_00001").mkdir(parents=True)
  with pytest.raises(config_lib.ConfigError, match=r"saved with config.data.tokenized_dir='' \(the on-the-fly"):
    loop.restore(checkpointer, 8, None, stream)
  accepted = global_stream.GlobalStream(_config(tokenized_corpus, accept_new_stream=True), Block(0, 1))
  loop.restore(checkpointer, 8, None, accepted)
  assert accepted.step == 8
  accepted.close()
  for s in (stream, other):
    s.close()


def test_a_damaged_stream_state_is_one_checkpoint_error_and_a_good_one_verifies(tokenized_corpus, tmp_path):
  from sparsetx.train import checkpointing

  config = _config(tokenized_corpus)
  config.checkpoint.update(async_save=False)
  stream = global_stream.GlobalStream(config, Block(0, 1), step=3)
  checkpointer = checkpointing.Checkpointer(str(tmp_path), config.checkpoint)
  checkpointer.save(3, {"w": np.ones(2, np.float32)}, config, stream)
  checkpointer.wait()
  assert checkpointer.resume_step() == 3  # verified with its data state
  state_file = tmp_path / "data_state" / "3" / global_stream.STATE_JSON
  state_file.write_text(state_file.read_text()[:20])
  with pytest.raises(checkpointing.CheckpointError, match=r"step 3 .*its data state file .*stream_state.json is unr"):
    checkpointer.resume_step()
  state_file.unlink()
  with pytest.raises(checkpointing.CheckpointError, match=r"step 3 .*its data state .*missing"):
    checkpointer.resume_step()
  checkpointer.close()
  stream.close()


def test_the_on_the_fly_path_suggests_pretokenizing_a_large_corpus_once(tmp_path, caplog, monkeypatch):
  text = tmp_path / "web.txt"
  text.write_text("a document\n" * 100)
  config = load_config("configs/tiny.py")
  pipeline.warn_if_pretokenizing_pays(config)  # the embedded corpus, one process: quiet
  config.data.sources.web = dict(kind="text", train=str(text))
  config.data.mixture = (("web", 1.0),)
  pipeline.warn_if_pretokenizing_pays(config)  # 1.1 kB: quiet
  assert "sparsetx-tokenize" not in caplog.text
  monkeypatch.setattr(pipeline, "LARGE_CORPUS_BYTES", 1000)
  pipeline.warn_if_pretokenizing_pays(config)
  assert caplog.text.count("run sparsetx-tokenize once and train with --config.data.tokenized_dir=DIR") == 1


def test_a_ladder_rung_on_a_target_trains_only_from_a_tokenized_corpus(tmp_path):
  from sparsetx.train import loop

  config = load_config("configs/ladder.py", "sgatlin,5,h100x8")
  assert config.data.require_tokenized and not load_config("configs/ladder.py", "sgatlin,5").data.require_tokenized
  with pytest.raises(config_lib.ConfigError, match=r"write one with sparsetx-tokenize .*--config.data.tokenized_dir"):
    loop.train(config, str(tmp_path))

"""The trainer on 8 simulated CPU devices: sharding invariance, resume, preemption, divergence, errors."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import MICRO_TRAIN_FLAGS, REPO, load_config, synthetic_batch

from sparsetx import config as config_lib
from sparsetx.data import global_stream, pretokenize
from sparsetx.parallel import logical_rules
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib
from sparsetx.train.checkpoints import checkpointing
from sparsetx.train.run import loop


def micro_config(ffn_type="sgatlin", **train):
  config = load_config("configs/tiny.py", ffn_type)
  config.model.update(d_model=64, n_layers=2, max_len=32, dtype="float32")
  config.data.update(seq_len=32, global_batch_size=8, eval_batch_size=8, shuffle_buffer=64)
  config.train.update(dict(steps=20, warmup_steps=5, log_every=1, eval_every=1000, eval_batches=1), **train)
  config.checkpoint.update(every=5)
  return config


def losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {row["step"]: row["loss"] for row in rows if "loss" in row}


def restore_params(config, workdir, mesh):
  abstract, _, _, _ = state_lib.state_shardings(config, mesh)
  manager = checkpointing.Checkpointer(workdir, config.checkpoint)
  step = manager.latest_step()
  state = manager.restore_state(step, abstract)
  manager.close()
  return step, state


def one_step(config, mesh):
  """(updated params, metrics, loss and gradients before the optimizer) of one step on `mesh`, as the trainer runs it."""
  built = state_lib.setup(config, mesh=mesh)
  shardings, model, sharding = built.shardings, built.model, built.batch_sharding
  state = state_lib.create_state(config, shardings, model, built.tx)
  batch = jax.device_put(synthetic_batch(config), sharding)
  step = step_lib.make_train_step(config, built)
  grads = jax.jit(
    lambda p, b: step_lib.loss_and_grads(p, b, model=model, train=config.train)[:2],
    in_shardings=(shardings.params, sharding),
  )
  with logical_rules.activate(mesh, config.mesh.rules):  # as the trainer runs it
    loss_and_grads = jax.device_get(grads(state.params, batch))
    new_state, metrics = step(state, batch)
  metrics = dict(metrics, **{f"usage_counts/{name}": counts for name, counts in new_state.usage.items()})
  return jax.device_get(new_state.params), jax.device_get(metrics), loss_and_grads


@pytest.mark.parametrize("ffn_type", ["mlp", "sgatlin", "fff"])
def test_sharded_step_equals_single_device(ffn_type):
  config = micro_config(ffn_type, warmup_steps=0)
  single = config_lib.default_config().mesh
  single.ici.update(data=1)
  step_1 = one_step(config, mesh_lib.make_mesh(single, jax.devices()[:1]))
  config.mesh.ici.update(data=2, fsdp=2, expert=2)
  mesh_8 = mesh_lib.make_mesh(config.mesh)
  assert mesh_8.size == 8
  assert_same_step(config, one_step(config, mesh_8), step_1)


def assert_same_step(config, step, want):
  """Same loss and gradients before the optimizer; updated parameters within what the update rule allows.

  Gradients differ between reduction orders by float32 rounding of their sums, so each leaf gets an
  absolute tolerance relative to its largest element. AdamW's first step moves an element by
  lr * m/(sqrt(v) + eps) = lr * g/(|g| + eps) plus decay, i.e. by at most lr, so a gradient at float-noise
  level may end up anywhere within 2 * lr of the reference: parameters are checked against that bound.
  """
  params, metrics, (loss, grads) = step
  want_params, want_metrics, (want_loss, want_grads) = want
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for name in ("loss", "grad_norm", "tokens"):
    np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=1e-5, err_msg=name)
  for name in (name for name in want_metrics if name.startswith("usage_counts/")):  # the window's counts: the picks
    np.testing.assert_array_equal(metrics[name], want_metrics[name], err_msg=name)
  for (path, a), b in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=jax.tree_util.keystr(path))
  lr = config.train.learning_rate
  for (path, a), b in zip(jax.tree.leaves_with_path(params), jax.tree.leaves(want_params)):
    np.testing.assert_allclose(a, b, rtol=0, atol=2 * lr * (1 + 1e-3), err_msg=jax.tree_util.keystr(path))


def test_microbatches_equal_one_batch():
  config = micro_config("sgatlin", warmup_steps=0)
  config.data.global_batch_size = 16
  mesh = mesh_lib.make_mesh(config.mesh)
  step_1 = one_step(config, mesh)
  config.train.microbatches = 2
  assert_same_step(config, one_step(config, mesh), step_1)


def run_cli(workdir, *flags, ffn_type="sgatlin"):
  """Starts `python -m sparsetx.train` on the micro config."""
  overrides = [
    *MICRO_TRAIN_FLAGS,
    "--config.data.shuffle_buffer=64",
    "--config.train.steps=20",
    "--config.train.warmup_steps=5",
    "--config.train.log_every=1",
    "--config.train.eval_every=1000",
    "--config.train.eval_batches=1",
    "--config.checkpoint.every=5",
  ]
  command = [sys.executable, "-m", "sparsetx.train", f"--config=configs/tiny.py:{ffn_type}", f"--workdir={workdir}"]
  log = open(f"{workdir}.log", "w+")  # a file, not a pipe: a full pipe would block the logging process
  process = subprocess.Popen(
    command + overrides + list(flags), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True
  )
  process.log = log
  return process


def finish(process, timeout=120) -> str:
  """Waits for the process; returns what it printed."""
  process.wait(timeout=timeout)
  process.log.seek(0)
  return process.log.read()


def wait_for_steps(workdir, n, process, timeout=240):
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + timeout
  while time.time() < deadline:
    if os.path.exists(path) and len(losses(workdir)) >= n:
      return
    assert process.poll() is None, finish(process)[-3000:]
    time.sleep(0.2)
  raise AssertionError(f"no {n} steps within {timeout}s")


def test_sigterm_saves_and_resume_is_bit_identical(tmp_path):
  uninterrupted, interrupted = str(tmp_path / "u"), str(tmp_path / "i")
  process = run_cli(interrupted, "--config.checkpoint.every=1000")
  wait_for_steps(interrupted, 3, process)
  process.send_signal(signal.SIGTERM)
  output = finish(process)
  assert process.returncode == 0, output[-3000:]
  stopped_at = max(losses(interrupted))
  assert 3 <= stopped_at < 20
  config = micro_config()
  final = loop.train(config, uninterrupted)
  # Validation loss after 20 steps: measured 4.85 (stories) and 4.84 (facts) from 6.25 at step 1;
  # a uniform guess over the 259 byte ids is ln(259) = 5.56.
  with open(os.path.join(uninterrupted, "metrics.jsonl")) as f:
    evals = [json.loads(line) for line in f if "eval/stories/loss" in line][-1]
  assert evals["eval/stories/loss"] < 5.2 and evals["eval/facts/loss"] < 5.2, evals
  assert final["loss"] < losses(uninterrupted)[1] - 1.0
  manager = checkpointing.Checkpointer(interrupted, config.checkpoint)
  assert manager.latest_step() == stopped_at  # saved at the step it stopped, though `every` is 1000
  manager.close()

  loop.train(micro_config(), interrupted)  # a new process resumes in the same workdir
  want, got = losses(uninterrupted), losses(interrupted)
  assert sorted(got) == list(range(1, 21))
  for step in range(1, 21):
    assert got[step] == want[step], step
  mesh = mesh_lib.make_mesh(config.mesh)
  (step_u, state_u), (step_i, state_i) = (
    restore_params(config, uninterrupted, mesh),
    restore_params(config, interrupted, mesh),
  )
  assert step_u == step_i == 20
  for a, b in zip(jax.tree.leaves(state_i.params), jax.tree.leaves(state_u.params)):
    np.testing.assert_array_equal(a, b)

  # The same checkpoint restored onto another mesh shape holds identical values.
  other = micro_config()
  other.mesh.ici.update(data=1, fsdp=4, expert=2)
  mesh_other = mesh_lib.make_mesh(other.mesh)
  _, state_other = restore_params(other, uninterrupted, mesh_other)
  leaf = state_other.params["layers_0"]["mlp"]["experts"]
  assert leaf.sharding.mesh.shape["expert"] == 2 and not leaf.sharding.is_fully_replicated
  for a, b in zip(jax.tree.leaves(state_other), jax.tree.leaves(state_u)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.long  # a system case of half a minute or more: make test-long
def test_kill_during_async_save_keeps_previous_checkpoint(tmp_path):
  workdir = str(tmp_path / "k")
  process = run_cli(workdir, "--config.checkpoint.every=1", "--config.train.steps=200")
  wait_for_steps(workdir, 4, process)
  process.send_signal(signal.SIGKILL)
  finish(process)
  config = micro_config(steps=200)
  manager = checkpointing.Checkpointer(workdir, config.checkpoint)
  latest = manager.latest_step()
  manager.close()
  assert latest is not None and latest >= 1
  config.train.update(steps=latest + 2, accept_schedule_change=True)  # a shorter run: its schedule changes
  loop.train(config, workdir)
  assert max(losses(workdir)) == latest + 2


def test_divergence_stops_with_the_step_and_saves_nothing_non_finite(tmp_path):
  config = micro_config("mlp", learning_rate=1e35, warmup_steps=0, steps=10)
  config.checkpoint.every = 1
  with pytest.raises(loop.NonFiniteLossError, match=r"training diverged at step \d+"):
    loop.train(config, str(tmp_path))
  manager = checkpointing.Checkpointer(str(tmp_path), config.checkpoint)
  abstract, _, _, _ = state_lib.state_shardings(config, mesh_lib.make_mesh(config.mesh))
  for step in manager.manager.all_steps():
    state = manager.restore_state(step, abstract)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state.params))
  manager.close()


@pytest.fixture(scope="module")
def pipeline_batches(tmp_path_factory):
  """20 real batches of the micro config's data, read once for every feed-forward type."""
  config = pretokenize.train_corpus(micro_config(), str(tmp_path_factory.mktemp("run")))
  mesh = mesh_lib.make_mesh(config.mesh)
  stream = global_stream.GlobalStream(config, mesh_lib.batch_sharding(mesh, config.mesh.rules))
  batches = [stream.next_local() for _ in range(20)]
  stream.close()
  return batches


@pytest.mark.parametrize("ffn_type", config_lib.FFN_TYPES)
def test_every_feed_forward_type_trains(ffn_type, pipeline_batches):
  config = micro_config(ffn_type, learning_rate=3e-3)
  config.mesh.ici.update(data=1)
  built = state_lib.setup(config, jax.devices()[:1])
  state = state_lib.create_state(config, built.shardings, built.model, built.tx)
  step = step_lib.make_train_step(config, built)
  losses = []
  for batch in pipeline_batches:
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 1.0, losses
  if ffn_type in ("sgatlin", "peer", "fff", "moe"):
    assert 0 < metrics["sparse/layers_0/used"] <= 1 and 0 <= metrics["sparse/layers_0/gini"] <= 1


def test_bad_inputs_fail_cleanly(tmp_path):
  config = micro_config()
  config.mesh.ici.update(data=3)
  with pytest.raises(config_lib.ConfigError, match=r"config.mesh.ici .* does not divide 8 devices"):
    loop.train(config, str(tmp_path / "a"))
  config = micro_config()
  config.data.global_batch_size = 12
  with pytest.raises(config_lib.ConfigError, match=r"config.data.global_batch_size=12 is not divisible by the 8"):
    loop.train(config, str(tmp_path / "b"))
  blocker = tmp_path / "file"
  blocker.write_text("")
  with pytest.raises(config_lib.ConfigError, match=r"--workdir=.* is not writable"):
    loop.train(micro_config(), str(blocker / "sub"))

  workdir = str(tmp_path / "c")
  loop.train(micro_config(steps=2), workdir)
  other = micro_config(steps=4)
  other.model.ffn.d_ffw = 16**2
  with pytest.raises(
    config_lib.ConfigError, match=r"config.model.ffn.d_ffw=256 but the checkpoint .* was trained with 1024"
  ):
    loop.train(other, workdir)
  assert max(losses(workdir)) == 2
  manager = checkpointing.Checkpointer(workdir, other.checkpoint)
  assert manager.manager.all_steps() == [2]  # the refused run wrote nothing
  manager.close()


def test_cli_reports_one_line_and_exit_code(tmp_path):
  process = run_cli(str(tmp_path / "x"), "--config.train.no_such_field=1")
  output = finish(process)
  assert process.returncode != 0 and "no_such_field" in output
  process = run_cli(str(tmp_path / "y"), "--config.mesh.ici.expert=3")
  output = finish(process)
  assert process.returncode == 2
  assert output.strip().splitlines()[-1].startswith("error: config.mesh.ici (data=-1, fsdp=1, tensor=1, expert=3)")


def test_console_is_a_summary_and_one_line_per_interval(tmp_path):
  """A tiny run prints its summary, one progress line per log interval, one line per evaluation and its end:
  no library INFO (orbax's checkpoint chatter, clu's metric lines), no TensorFlow start-up notices."""
  workdir = tmp_path / "q"
  process = run_cli(
    str(workdir),
    "--config.train.steps=4",
    "--config.train.log_every=2",
    "--config.train.eval_every=2",
    "--config.checkpoint.every=2",
    ffn_type="mlp",
  )
  lines = finish(process).splitlines()
  assert process.returncode == 0, lines
  table = next(i for i, line in enumerate(lines) if "Where the time went (1 run of this workdir" in line)
  assert [line.split()[0] for line in lines[table + 1 : table + 8]] == [
    "init",
    "compile",
    "waiting",
    "productive",
    "steps",
    "checkpoint",
    "evaluation",
  ], lines[table:]
  lines = lines[:table] + lines[table + 8 :]
  # summary, the first step's time, 2 progress, 2 evaluations, done (and room for a stray warning)
  assert len(lines) <= 9, lines
  own = [f"{path.name}:" for path in (REPO / "sparsetx" / "train" / "run").rglob("*.py")] + ["__main__.py"]
  assert not [
    line
    for line in lines
    if line.startswith(("I", "E0000", "WARNING: All log"))
    and "sparsetx" not in line
    and not any(name in line for name in own)  # the run's own lines: the loop and its operations
  ], lines
  progress = [line for line in lines if "] step " in line and "loss" in line and "ETA" in line]
  assert [line.split("] ")[1].split()[:2] for line in progress] == [["step", "2/4"], ["step", "4/4"]], lines
  assert all(re.search(r"loss \d\.\d{4}  [\d,]+ ms/step  [\d,]+ tokens/s  ETA", line) for line in progress), progress
  assert any("mlp model (2 layers, d_model 64)" in line and "256 tokens per step (8 x 32)" in line for line in lines)
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["train"]["steps"] == 4 and saved["model"]["ffn"]["type"] == "mlp"
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert any({"loss", "grad_norm", "tokens_per_sec", "learning_rate"} <= row.keys() for row in rows)  # all metrics

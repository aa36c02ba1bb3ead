"""The autotuner's checks (plan/autotune.py): each timing taken on the device its table entry names (a child on
another one refused; a TPU measured in-process), candidates checked on the shapes training meets (ragged groups,
hot rows, the d-split form, bf16 tables, a child's exit code), a budget, and the trainer's take_from ->
ensure_tuned -> keep_in path."""

import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, load_config

from sparsetx import config as config_lib
from sparsetx.kernels import autotune_table, op_calls
from sparsetx.kernels.device import TracedDevice
from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows.reference import identity
from sparsetx.parallel import distributed
from sparsetx.plan import autotune
from sparsetx.train.run import loop

SPEC, F32, BF16 = jax.ShapeDtypeStruct, jnp.float32, jnp.bfloat16
CALL = op_calls.gather(SPEC((1024, 32), F32), SPEC((64, 32), F32), F32, 4, identity, True, False, False, False)
KEY = op_calls.shape_class(CALL)
SPARSE = op_calls.gather(SPEC((256, 32), F32), SPEC((4096, 32), F32), F32, 4, identity, True, False, False, False)
TPU = TracedDevice("tpu", "TPU v5p", 2)
H100 = TracedDevice("gpu", "NVIDIA H100 80GB HBM3", 132)


@pytest.fixture
def table(tmp_path, monkeypatch):
  """An empty table of this test's own; the child processes find the fakes (tests/ on their path) and the table."""
  monkeypatch.setenv(autotune_table.ENV, str(tmp_path / "autotune.json"))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
  return tmp_path / "autotune.json"


def kinds_saved(table) -> set:
  """The device kinds the table file holds entries for."""
  if not table.exists():
    return set()
  return {name.partition(" | ")[0] for name in json.loads(table.read_text())["entries"]}


def children_counted(monkeypatch) -> list:
  """Counts the child processes the autotuner starts (each still runs)."""
  started, real = [], autotune.measure
  monkeypatch.setattr(autotune, "measure", lambda *a, **k: started.append(a[1]) or real(*a, **k))
  return started


def no_children(monkeypatch) -> None:
  def refused(*args, **kwargs):
    raise AssertionError(f"a child process was started for {args[1]}")

  monkeypatch.setattr(autotune, "measure", refused)


def test_a_tpu_is_measured_in_this_process_and_a_cpu_process_is_refused(table, monkeypatch):
  """A TPU cannot be shared with a child: its candidates run in the process holding it, and only where that process
  runs on the entry's device. Here it runs on a CPU: nothing is measured, nothing written under the TPU's key, and
  one line names every call left to the default order."""
  monkeypatch.setattr(autotune, "target", lambda: TPU)
  no_children(monkeypatch)
  with pytest.raises(autotune.WrongDevice, match="this process runs on cpu, not on TPU v5p"):
    autotune.tune("rows", KEY, CALL, KernelOptions(), ["xla"], 1)
  lines = []
  other = dict(CALL, d_model=64)
  todo = {("rows", KEY): CALL, ("rows", op_calls.shape_class(other)): other}
  assert autotune.tune_all(todo, KernelOptions(), lines.append, specs=["xla"], rounds=1) == {}
  assert kinds_saved(table) == set()
  [line] = [line for line in lines if "not measured" in line]
  assert "not on TPU v5p" in line and KEY in line and op_calls.shape_class(other) in line, lines
  assert "auto takes the default order for them" in line, line


@pytest.mark.parametrize("device", [TPU, H100], ids=["tpu", "exclusive gpu"])
def test_a_child_on_another_device_is_refused_and_nothing_is_recorded(table, monkeypatch, device):
  """A child that could not open the entry's device falls back to the CPU (a TPU held by its parent, were one
  spawned; a GPU in exclusive-process mode): its report names the CPU, the call is dropped after that first child,
  and nothing CPU-timed is written under the device's key."""
  monkeypatch.setattr(autotune, "target", lambda: device)
  monkeypatch.setattr(autotune, "in_process", lambda: False)  # the TPU: as the autotuner did before
  monkeypatch.setenv(autotune.PREALLOCATE, "false")
  started = children_counted(monkeypatch)
  with pytest.raises(autotune.WrongDevice, match=f"'s child process ran on cpu, not on {device.device_kind}"):
    autotune.tune("rows", KEY, CALL, KernelOptions(), ["xla", "xla_row_order"], 1)
  assert started == ["xla"] and kinds_saved(table) == set()


def test_in_process_candidates_pass_the_childrens_gate(table, monkeypatch):
  """Where this process runs on the entry's device (faked: a TPU), each candidate runs here, one at a time, under
  the same check: wrong values dropped, an exception dropped as faulted (not the process); the entry goes under that
  device's key and no child is started. A candidate still running at its cap raises Hung at the cap, not after it."""
  monkeypatch.setattr(autotune, "target", lambda: TPU)
  monkeypatch.setattr(autotune, "this_device", lambda: TPU.device_kind)
  no_children(monkeypatch)
  specs = ["xla", "autotune_fakes:WRONG", "autotune_fakes:RAISES"]
  entry = autotune.tune("rows", KEY, CALL, KernelOptions(), specs, 1)
  assert entry.ranking == ("xla",), entry
  assert entry.dropped["autotune_fakes:WRONG"].startswith("wrong values: "), entry.dropped
  assert entry.dropped["autotune_fakes:RAISES"].startswith("faulted: raised RuntimeError: the kernel failed"), entry
  assert kinds_saved(table) == {TPU.device_kind}
  started = time.monotonic()
  with pytest.raises(autotune.Hung, match=r"autotune_fakes:HANGS ran for more than 1 s in this process"):
    autotune.measure_in_process("rows", "autotune_fakes:HANGS", CALL, KernelOptions(), 1, cap_s=1.0)
  assert time.monotonic() - started < 30  # the fake hangs for minutes


def test_a_candidate_that_hangs_this_process_leaves_its_verdict_and_ends_it(table, monkeypatch):
  """On a TPU nothing can stop a hung program: its verdict and the reference's go in the table, then the process
  ends with one line (exit 6, which the deploy recipes restart on), and the restart measures nothing again."""
  monkeypatch.setattr(autotune, "target", lambda: TPU)
  monkeypatch.setattr(autotune, "this_device", lambda: TPU.device_kind)
  monkeypatch.setattr(autotune, "CHILD_TIMEOUT_S", 1.0)
  ended = []
  monkeypatch.setattr(autotune, "_end_hung", lambda what: ended.append(what) or sys.exit(6))
  with pytest.raises(SystemExit):
    autotune.tune("rows", KEY, CALL, KernelOptions(), ["xla", "autotune_fakes:HANGS", "autotune_fakes:SLOW"], 1)
  assert len(ended) == 1 and "autotune_fakes:HANGS ran for more than 1 s" in ended[0], ended
  entry = autotune_table.lookup(TPU.device_kind, "rows", KEY, KernelOptions())
  assert entry.ranking == ("xla",) and entry.dropped["autotune_fakes:HANGS"].startswith("timed out: "), entry
  assert entry.dropped["autotune_fakes:SLOW"] == "not measured: autotune_fakes:HANGS hung the process before it"
  assert autotune.missing({("rows", KEY): CALL}, KernelOptions()) == {}


def test_a_grouped_kernel_that_ignores_group_sizes_is_refused(table):
  """Groups as a router makes them (one empty, sizes no tile divides, rows after the last group) against
  ragged_dot: a grouped matmul that splits the rows equally, right on equal groups, is dropped."""
  call = op_calls.grouped(SPEC((64, 32), F32), SPEC((4, 32, 16), F32))
  (lhs, rhs), (sizes, _) = autotune.inputs(call, KernelOptions())
  sizes = np.asarray(sizes)
  assert 0 in sizes and sizes.sum() < 64 and any(size % 8 for size in sizes), sizes
  specs = ["xla", "autotune_fakes:IGNORES_GROUP_SIZES"]
  entry = autotune.tune("grouped_matmul", op_calls.shape_class(call), call, KernelOptions(), specs, 1)
  assert entry.ranking == ("xla",), entry
  assert entry.dropped["autotune_fakes:IGNORES_GROUP_SIZES"].startswith("wrong values: "), entry


def test_hot_rows_take_the_cut_and_combine_path(monkeypatch):
  """Rows drawn as routing picks them: one row taken by more than two segment_chunks of pairs, a skewed rest and
  uniform ones. A kernel wrong only on the cut pieces of a hot row is dropped; uniform rows would have passed it."""
  options = KernelOptions(segment_chunk=64)
  rows = autotune.skewed_rows(256, 4, 4096, 64)
  counts = np.bincount(rows.reshape(-1), minlength=4096)
  assert counts.max() > 2 * 64 and counts.max() % 64 and (counts == 1).sum() > 100, np.sort(counts)[-5:]
  assert np.all(rows[: 2 * 64 + 32 + 1, 0] == np.argmax(counts)), "the hot row is in the first slot of 161 tokens"
  hot = autotune.measure_here("rows", "autotune_fakes:HOT_ROWS_WRONG", SPARSE, options, 1)
  assert hot.ms is None and hot.why.startswith("wrong values: "), hot
  uniform = lambda tokens, slots, n_rows, chunk: np.random.default_rng(0).integers(0, n_rows, (tokens, slots))  # noqa: E731
  monkeypatch.setattr(autotune, "skewed_rows", uniform)
  assert autotune.measure_here("rows", "autotune_fakes:HOT_ROWS_WRONG", SPARSE, options, 1).ms is not None


def test_a_d_split_call_is_checked_in_its_d_split_form():
  """A call the step makes on a d_model-split table runs the d-split's partial dots (inside a shard_map over a
  d-group, here of one device): a kernel wrong only there passes the whole-row form and is dropped in this one."""
  assert autotune.measure_here("rows", "autotune_fakes:WRONG_SLICES", CALL, KernelOptions(), 1).ms is not None
  split = autotune.measure_here("rows", "autotune_fakes:WRONG_SLICES", dict(CALL, d_split=True), KernelOptions(), 1)
  assert split.ms is None and split.why.startswith("wrong values: "), split
  assert autotune.measure_here("rows", "xla_row_order", dict(CALL, d_split=True), KernelOptions(), 1).ms is not None


def test_each_output_has_its_own_tolerance():
  """A bf16 step with float32 tables: the table gradients are float32 sums of values exact in float32, so a kernel
  that rounds them to bf16 is dropped (with the step's bf16 slack it would pass); tables the call says are bf16
  are drawn in bf16, and their gradients get bf16 slack."""
  call = op_calls.gather(SPEC((256, 64), BF16), SPEC((512, 64), F32), BF16, 8, identity, True, False, False, False)
  rounded = autotune.measure_here("rows", "autotune_fakes:ROUNDS_TABLE_SUMS", call, KernelOptions(), 1)
  assert rounded.ms is None and rounded.why.startswith("wrong values: "), rounded
  bf16_tables = dict(call, table_dtype="bfloat16")
  (x, w_in, w_out, gates), _ = autotune.inputs(bf16_tables, KernelOptions())
  assert (x.dtype, w_in.dtype, w_out.dtype, gates.dtype) == (BF16, BF16, BF16, F32)
  assert autotune.measure_here("rows", "autotune_fakes:ROUNDS_TABLE_SUMS", bf16_tables, KernelOptions(), 1).ms


def test_a_child_that_answers_then_exits_non_zero_is_faulted(table):
  measured = autotune.measure("rows", "autotune_fakes:EXITS_AFTER_ANSWERING", CALL, KernelOptions(), 1)
  assert measured.ms is None and measured.why.startswith("faulted: exit code 7 after it answered"), measured


def test_children_compile_into_the_parents_cache(table, tmp_path):
  """The trainer's compilation cache (its workdir's) reaches the children: a restart's candidates compile once."""
  before = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
  try:
    measured = autotune.measure("rows", "autotune_fakes:REPORTS_CACHE", CALL, KernelOptions(), 1)
  finally:
    jax.config.update("jax_compilation_cache_dir", before)
  assert measured.why == f"raised: JAX_COMPILATION_CACHE_DIR={tmp_path / 'cache'}", measured


def test_a_spent_budget_leaves_the_rest_to_the_default_order(table, monkeypatch):
  """A child still running when the budget ends is stopped; its call and those after it are not measured, one line
  names them, and nothing is recorded where the reference had not answered (where it had: test below). A budget
  of 0 starts nothing."""
  other = dict(CALL, d_model=64)
  todo = {("rows", KEY): CALL, ("rows", op_calls.shape_class(other)): other}
  lines = []
  entries = autotune.tune_all(todo, KernelOptions(), lines.append, 3, ["autotune_fakes:HANGS"], 1)
  assert entries == {} and kinds_saved(table) == set()
  [line] = [line for line in lines if "not measured" in line]
  assert line.startswith("autotune: the budget of 3 s is spent; not measured: ") and KEY in line, line
  assert op_calls.shape_class(other) in line and "auto takes the default order for them" in line, line
  no_children(monkeypatch)
  assert autotune.tune_all(todo, KernelOptions(), lines.append, 0, ["xla"], 1) == {}


@pytest.mark.long  # a child held to the budget's end; the trainer with its children
def test_a_budget_spent_after_the_reference_keeps_what_was_measured(table):
  """The reference answered, then the budget ran out: the entry keeps XLA and names what was not measured, so the
  next start does not spend its budget on the same call again."""
  lines = []
  entries = autotune.tune_all(
    {("rows", KEY): CALL}, KernelOptions(), lines.append, 20, ["xla", "autotune_fakes:HANGS"], 1
  )
  entry = entries["rows", KEY]
  assert entry.ranking == ("xla",) and entry.dropped == {
    "autotune_fakes:HANGS": "not measured: the autotune budget ran out"
  }
  assert autotune.missing({("rows", KEY): CALL}, KernelOptions()) == {}


def test_a_held_entry_is_kept_even_unusable_and_other_options_are_missing(table):
  """An entry with nothing usable is not measured again at every start (it would fail the same way, minutes each
  time); an entry measured with another segment_chunk is another entry."""
  unusable = autotune_table.Entry((), {"xla": "timed out: no answer in 300 s"}, {})
  other = dict(CALL, d_model=64)
  calls = {("rows", KEY): CALL, ("rows", op_calls.shape_class(other)): other}
  chunk_64, chunk_32 = KernelOptions(segment_chunk=64), KernelOptions(segment_chunk=32)
  autotune_table.record("cpu", "rows", KEY, unusable, options=chunk_64)
  assert list(autotune.missing(calls, chunk_64)) == [("rows", op_calls.shape_class(other))]
  assert list(autotune.missing(calls, chunk_32)) == list(calls)
  line = autotune.summary(calls, autotune.missing(calls, chunk_64), chunk_64)
  assert line.startswith("2 op shapes in the step, 1 to measure (those the table lacks; 1 held with nothing"), line
  assert "auto takes the default order for them, --again measures them anew" in line, line
  line = autotune.summary(calls, autotune.missing(calls, chunk_32), chunk_32)
  assert line.startswith("2 op shapes in the step, 2 to measure (those the table lacks; 0 held"), line


def test_only_a_process_that_will_measure_gives_up_preallocation():
  """From the config and the environment alone, before JAX starts: a sparse layer under `auto` with the table on,
  in one process."""
  single = distributed.Spec(distributed.SINGLE)
  sgatlin = load_config("configs/tiny.py", "sgatlin")
  assert autotune.will_measure(sgatlin, single)
  assert autotune.will_measure(load_config("configs/tiny.py", "moe"), single)
  assert not autotune.will_measure(load_config("configs/tiny.py", "mlp"), single)
  assert not autotune.will_measure(sgatlin, distributed.Spec(distributed.SLURM, "node-1:1", 2, 0))
  assert autotune.will_measure(sgatlin, distributed.Spec(distributed.FLAGS, "localhost:1", 1, 0))
  named = load_config("configs/tiny.py", "sgatlin")
  named.model.ffn.kernel.implementation = "xla"
  off = load_config("configs/tiny.py", "sgatlin")
  off.train.autotune = False
  no_budget = load_config("configs/tiny.py", "sgatlin")
  no_budget.train.autotune_budget_s = 0.0
  assert not autotune.will_measure(named, single) and not autotune.will_measure(off, single)
  assert not autotune.will_measure(no_budget, single)


@pytest.mark.long  # two trainer starts and their children
def test_the_trainer_measures_what_its_table_lacks_and_a_restart_takes_the_workdirs_copy(
  table, tmp_path, monkeypatch, caplog
):
  """loop.train on a target faked as a GPU whose kind is what the children report ("cpu", so their timings are
  accepted; the step itself still runs XLA on the CPU): the first start measures every call of its step in child
  processes and keeps the table in its workdir; a restart on a fresh host (no table) takes the workdir's copy and
  starts no child. This proves the trainer's wiring, not a kernel choice."""
  monkeypatch.setattr(autotune, "target", lambda: TracedDevice("gpu", "cpu", None))
  monkeypatch.setenv(autotune.PREALLOCATE, "false")
  config = load_config("configs/tiny.py", "sgatlin")
  config.model.update(d_model=32, n_layers=1, head_dim=32, max_len=16, dtype="float32")
  config.data.update(seq_len=16, global_batch_size=8, eval_batch_size=8, shuffle_buffer=8)
  config.train.update(steps=1, warmup_steps=1, log_every=1, eval_every=1000, eval_batches=1)
  workdir = tmp_path / "run"
  started = children_counted(monkeypatch)
  caplog.set_level(logging.INFO)
  loop.train(config_lib.validate(config), str(workdir))
  entries = json.loads(table.read_text())["entries"]
  assert entries and kinds_saved(table) == {"cpu"}, entries
  assert len(started) == 2 * len(entries) and set(started) == {"xla", "xla_row_order"}, started
  assert json.loads((workdir / autotune_table.WORKDIR_COPY).read_text())["entries"] == entries
  assert any(
    f"{len(entries)} to measure" in r.getMessage() and "budget 600 s" in r.getMessage() for r in caplog.records
  )

  table.unlink()  # the next host
  no_children(monkeypatch)
  config.train.update(steps=2, accept_schedule_change=True)  # a longer run: its schedule changes
  loop.train(config_lib.validate(config), str(workdir))
  assert json.loads(table.read_text())["entries"] == entries


def test_a_table_row_few_tokens_pick_is_held_to_its_own_bound():
  """A table gradient whose hot row sums ten million pairs must not lend its slack to a row of 3: zeroing the cold rows
  is caught, while float32 reassociation noise of each row's own size passes."""
  rng = np.random.default_rng(0)
  pairs_R = np.array([10_000_000, 3, 3, 3]) + 64
  want = rng.standard_normal((4, 64)) * np.sqrt(pairs_R)[:, None]  # a sum of n unit terms grows as sqrt(n)
  bound_of = dict(dw=(jnp.dtype(jnp.float32), pairs_R))
  cold_zeroed = want.copy()
  cold_zeroed[1:] = 0.0
  assert autotune.worst_error(dict(dw=cold_zeroed), dict(dw=want), bound_of) > 1.0
  noise = want * (1 + rng.uniform(-1, 1, want.shape) * 2**-24 * pairs_R[:, None])  # n roundings of each row's own
  assert autotune.worst_error(dict(dw=noise), dict(dw=want), bound_of) <= 1.0


def test_moe_weights_are_measured_in_their_own_dtype():
  """bf16 expert weights make another call than float32 ones (another table entry) and are drawn in bf16."""
  f32, bf16 = (op_calls.grouped(SPEC((64, 32), jnp.bfloat16), SPEC((4, 32, 16), w)) for w in (F32, jnp.bfloat16))
  assert op_calls.shape_class(f32) != op_calls.shape_class(bf16)
  (_, rhs), _ = autotune.inputs(bf16, KernelOptions())
  assert rhs.dtype == jnp.bfloat16
  assert autotune.measure_here("grouped_matmul", "xla", bf16, KernelOptions(), 1).ms is not None

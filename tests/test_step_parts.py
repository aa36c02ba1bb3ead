"""Where a train step's device time goes (perf/step_parts.py, sparsetx-bench-step-parts): the named scopes reach the
compiled program's ops, forward and backward, and a profiler trace of the step on this CPU breaks it into parts
that add up to the step."""

import types

import jax
import jax.numpy as jnp
import pytest

from sparsetx import scopes
from sparsetx.measure import step_bench
from sparsetx.perf import hlo_text, step_parts
from sparsetx.tools import bench_step_parts

GAPS = 0.3  # the most of a run's span no op runs in (launches between ops, the trace's overhead; 2-7% seen); a part
# the trace missed would show below it (attention alone is about 40% of the MLP step here)


def small_args():
  args = types.SimpleNamespace(scale=None, batch=4, seq_len=None, dtype=None, small=True, implementation=None)
  return step_bench.with_defaults(args)


@pytest.fixture(scope="module")
def steps():
  """mlp and sgatlin (its tables' gradients by sorted pairs, not the CPU's one row-order walk) at --small."""
  args, devices = small_args(), jax.devices()[:1]
  config = step_bench.rung_config("sgatlin", args)
  config.model.ffn.kernel.row_sorted = False
  return {
    "mlp": step_bench.TypeStep("mlp", args, devices),
    "sgatlin": step_bench.TypeStep("sgatlin", args, devices, config),
  }


def test_scopes_strip_the_transformations_jax_wraps_them_in():
  assert step_parts.part_of("jit(train_step)/transpose(jvp(loss))/while/body/eval_jaxpr/dot_general") == (
    "loss + lm head"
  )
  assert step_parts.part_of("jit(train_step)/transpose(jvp(Transformer))/layers_1/mlp/table_grads/sort/sort") == (
    "table grads: sort"
  )
  assert step_parts.part_of("jit(train_step)/jvp(Transformer)/layers_0/attention/query/dot_general") == "attention"
  assert step_parts.part_of("jit(train_step)/jvp(Transformer)/embed/jit(_take)/gather") == "rest"


def test_every_sparse_part_reaches_the_compiled_ops(steps):
  """The compiled sgatlin step has ops in each part its CPU form runs (the combine of cut rows is a kernel
  path's); the dense step has none of the sparse parts."""
  found = {
    name: {step_parts.part_of(op) for op in step_parts.op_names(step.step.as_text()).values()}
    for name, step in steps.items()
  }
  sparse = {"ffn router + top-k", "row gathers", "table grads: sort", "table grads: segment sums"}
  common = {"attention", "ffn dense", "loss + lm head", "optimizer", "rest"}
  assert sparse | common <= found["sgatlin"], found["sgatlin"]
  assert common <= found["mlp"] and not sparse & found["mlp"], found["mlp"]


def test_a_traced_step_breaks_into_parts_that_add_up_to_it(steps):
  breakdowns = {name: bench_step_parts.breakdown(step, rounds=2) for name, step in steps.items()}
  for name, b in breakdowns.items():
    assert b.runs == 2 and set(b.parts_s) == set(step_parts.PARTS), name
    assert all(seconds >= 0 for seconds in b.parts_s.values()), b.parts_s
    assert (1 - GAPS) * b.step_s <= b.busy_s, (name, b.busy_s, b.step_s)  # (never above the span: by construction)
  sgatlin, mlp = breakdowns["sgatlin"].parts_s, breakdowns["mlp"].parts_s
  assert all(sgatlin[part] > 0 for part in ("ffn router + top-k", "row gathers", "table grads: segment sums"))
  assert mlp["row gathers"] == mlp["ffn router + top-k"] == 0
  table = bench_step_parts.format_table(list(breakdowns), list(breakdowns.values()))
  assert table.splitlines()[0].split()[:3] == ["part", "mlp", "ms"] and "table grads: sort" in table


def test_compiled_parts_count_a_loop_bodys_launches_once_per_trip():
  """Read from a compiled program's text (no run): each launch in its part, a loop body's once per trip (7), each
  with the bytes of the arrays it is handed and returns ([256, 256] float32 here); the parts hold every launch."""
  array = 256 * 256 * 4

  def program(x):
    with jax.named_scope(scopes.OPTIMIZER):
      y = jnp.sin(x)
    with jax.named_scope(scopes.LOSS):
      y, _ = jax.lax.scan(lambda c, _: (jnp.cos(c) * 2.0, None), y, None, length=7)
    return y

  text = jax.jit(program).lower(jnp.ones((256, 256), jnp.float32)).compile().as_text()
  launches = hlo_text.launches(text)
  parts = step_parts.compiled_parts(text)
  assert parts["optimizer"] == step_parts.CompiledPart(1, array, array)
  in_loop = [launch for launch in launches if launch.result_bytes == array and "while/body" in launch.op_name]
  assert sum(launch.runs for launch in in_loop) == 7 and {launch.operand_bytes for launch in in_loop} == {array}
  assert parts["loss + lm head"].kernels >= 7 and parts["loss + lm head"].result_bytes >= 7 * array
  assert sum(part.kernels for part in parts.values()) == sum(launch.runs for launch in launches)


@pytest.mark.long  # a system case of half a minute or more: make test-long
def test_the_compiled_table_of_a_gpu_step(capsys):
  """--topology: the steps compiled for an H100 here, read by part: sgatlin's router, row kernels (forward and
  backward: 4 a layer at least) and table gradients are launched in their parts, the MLP's step has none of them."""
  args = small_args()
  vars(args).update(types=["mlp", "sgatlin"], topology="h100:1x1x1", logits_dot_in_fp32=True, loss_chunks=None)
  bench_step_parts.compiled_main(args)
  rows = {line[:28].strip(): line[28:].split() for line in capsys.readouterr().out.splitlines()[2:]}
  kernels = lambda part, column: int(rows[part][3 * column])  # noqa: E731
  for part in ("ffn router + top-k", "row gathers", "table grads: sort", "table grads: segment sums"):
    assert kernels(part, 1) > 0 and kernels(part, 0) == 0, part
  assert kernels("row gathers", 1) >= 4 * 2  # --small: 2 layers


def profile_of(planes: dict):
  """A loaded trace's shape (jax.profiler.ProfileData): {plane name: {line name: [(op or None, run id or None[,
  module])]}}, each op 1 ms long, one after another; module (default jit_train_step) "" names the op by the event
  alone, as a TPU's "XLA Ops" line does."""
  clock = iter(range(0, 10**9, 10**6))

  def event(op, run, module="jit_train_step"):
    stats = [] if op is None or not module else [("hlo_op", op), ("hlo_module", module)]
    stats += [] if run is None else [("run_id", run)]
    return types.SimpleNamespace(name=op or "kernel", start_ns=next(clock), duration_ns=10**6, stats=stats)

  return types.SimpleNamespace(
    planes=[
      types.SimpleNamespace(
        name=plane,
        lines=[types.SimpleNamespace(name=line, events=[event(*e) for e in es]) for line, es in lines.items()],
      )
      for plane, lines in planes.items()
    ]
  )


PROGRAM = '  %fusion.1 = f32[8]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(train_step)/optimizer/add"}'
HOST = {"/host:CPU": {"python": [("fusion.1", 1), ("fusion.1", 2)]}}  # launches the host timed


def test_a_trace_read_by_run_gives_each_run_its_span_and_parts():
  profile = profile_of({"/device:GPU:0": {"Stream #13": [("fusion.1", 1), ("fusion.1", 2)]}, **HOST})
  breakdown = step_parts.read_profile(profile, PROGRAM, "jit_train_step", rounds=2)
  assert breakdown.runs == 2 and breakdown.step_s == pytest.approx(1e-3)
  assert breakdown.parts_s["optimizer"] == pytest.approx(1e-3) and breakdown.busy_s == pytest.approx(1e-3)


def test_device_events_the_reader_does_not_know_are_one_error_not_the_hosts_time():
  """A GPU trace whose kernels carry no hlo_op stats: read as the host's launches, the parts would look measured."""
  profile = profile_of({"/device:GPU:0": {"Stream #13": [(None, None), (None, None)]}, **HOST})
  with pytest.raises(step_parts.TraceError, match=r"device planes \(/device:GPU:0\) hold 2 events, none of them"):
    step_parts.read_profile(profile, PROGRAM, "jit_train_step", rounds=2)


def test_runs_that_differ_from_the_rounds_traced_are_one_error():
  """Device events without run ids merge the rounds into one run: its span would be both rounds and the gap."""
  profile = profile_of({"/device:GPU:0": {"Stream #13": [("fusion.1", None), ("fusion.1", None)]}})
  with pytest.raises(step_parts.TraceError, match="holds 1 runs of jit_train_step. .by their run_id stats., not the 2"):
    step_parts.read_profile(profile, PROGRAM, "jit_train_step", rounds=2)


def test_another_programs_ops_do_not_count():
  """An evaluation step traced beside the train step: its ops on the same stream are not the step's."""
  ops = [("fusion.1", 1), ("fusion.1", 1, "jit_eval_step"), ("fusion.1", 2), ("fusion.1", 2, "jit_eval_step")]
  breakdown = step_parts.read_profile(profile_of({"/device:GPU:0": {"Stream #13": ops}}), PROGRAM, "jit_train_step", 2)
  assert breakdown.step_s == pytest.approx(1e-3) and breakdown.parts_s["optimizer"] == pytest.approx(1e-3)


def test_a_tpu_trace_is_read_from_its_xla_ops_line():
  """A TPU's device plane names each op by its event on the "XLA Ops" line, without hlo_op stats; its other lines
  (the modules, the steps) are not ops."""
  tpu = {"XLA Ops": [("fusion.1", 1, ""), ("fusion.1", 2, "")], "XLA Modules": [("jit_train_step", 1, "")]}
  breakdown = step_parts.read_profile(profile_of({"/device:TPU:0": tpu}), PROGRAM, "jit_train_step", rounds=2)
  assert breakdown.runs == 2 and breakdown.parts_s["optimizer"] == pytest.approx(1e-3)

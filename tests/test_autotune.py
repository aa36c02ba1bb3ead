"""The device chooses its kernels (plan/autotune.py): every candidate measured in its own child process, checked
against XLA's values, the fastest correct one kept with the reason each other was dropped; `auto` then reads the
table, and a second process measures nothing again."""

import json
import os
import subprocess
import sys
import types
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MICRO_TRAIN_FLAGS, REPO, load_config
from etils import epath
from kernel_cases import gather_case

from sparsetx import config as config_lib
from sparsetx.config import ConfigError
from sparsetx.kernels import autotune_table, op_calls, registry
from sparsetx.kernels.device import TracedDevice
from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows import xla
from sparsetx.kernels.rows.gated_gather import gated_gather
from sparsetx.kernels.rows.records import Rows
from sparsetx.kernels.rows.reference import identity
from sparsetx.plan import autotune
from sparsetx.train import state as state_lib
from sparsetx.train import step_kernels

X, TABLE = jax.ShapeDtypeStruct((1024, 32), jnp.float32), jax.ShapeDtypeStruct((64, 32), jnp.float32)
CALL = op_calls.gather(X, TABLE, jnp.float32, 4, identity, True, False, False, False)  # sgatlin's: identity, no bias


@pytest.fixture
def table(tmp_path, monkeypatch):
  """An empty table of this test's own; the child processes find the fakes (tests/ on their path) and the table."""
  monkeypatch.setenv(autotune_table.ENV, str(tmp_path / "autotune.json"))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
  return tmp_path / "autotune.json"


def test_each_candidate_is_dropped_with_its_reason_and_the_fastest_correct_is_chosen(table):
  fakes = ["SLOW", "REFUSES", "FAULTS", "WRONG", "WRONG_GRADIENTS", "FAST", "FAST@block_tokens=16"]
  entry = autotune.tune("rows", "float32 D32 S4", CALL, KernelOptions(), [f"autotune_fakes:{f}" for f in fakes], 3)
  # three ran and matched XLA's values (FAST at a tiling too, as fast: either may lead); SLOW sleeps 50 ms a run
  assert set(entry.ranking[:2]) == {"autotune_fakes:FAST", "autotune_fakes:FAST@block_tokens=16"}, entry
  assert entry.ranking[2:] == ("autotune_fakes:SLOW",), entry
  assert entry.dropped["autotune_fakes:REFUSES"] == "raised: it needs a Hopper GPU (a test implementation)"
  assert entry.dropped["autotune_fakes:FAULTS"].startswith("faulted: killed by SIGILL"), entry.dropped
  assert entry.dropped["autotune_fakes:WRONG"].startswith("wrong values: "), entry.dropped
  assert entry.dropped["autotune_fakes:WRONG_GRADIENTS"].startswith("wrong values: "), entry.dropped
  saved = json.loads(table.read_text())["entries"]
  assert list(saved) == [autotune_table.key("cpu", "rows", "float32 D32 S4")]


def test_auto_takes_the_tables_ranking_and_refuses_what_it_dropped(table):
  """On an H100 (a traced device) without a table auto takes Triton; with one it takes the ranking's first, and
  an implementation the device saw fault is not tried; an implementation the config names runs (the table rules
  `auto` only)."""
  h100 = TracedDevice("gpu", "NVIDIA H100 80GB HBM3", 132)
  with unittest.mock.patch.object(registry, "target", lambda: h100):
    assert registry.rows(KernelOptions(), "bfloat16 D512 S128").name == "triton"
    entry = autotune_table.Entry(("xla", "mosaic"), {"triton": "faulted: killed by SIGILL"}, {"xla": 1.0})
    autotune_table.record(h100.device_kind, "rows", "bfloat16 D512 S128", entry)
    assert registry.rows(KernelOptions(), "bfloat16 D512 S128").name == "xla"
    assert registry.rows(KernelOptions(), "bfloat16 D256 S128").name == "triton"  # another shape class
    assert registry.rows(KernelOptions("triton,xla"), "bfloat16 D512 S128").name == "triton"  # named: no table


def test_a_ranked_tiling_runs_where_the_table_put_it(table):
  """A table whose first choice is Triton at a tiling makes `auto` on an H100 take Triton with those knobs (the
  config's other knobs kept); the same implementation untiled comes next."""
  h100 = TracedDevice("gpu", "NVIDIA H100 80GB HBM3", 132)
  entry = autotune_table.Entry(("triton@block_d=256,block_tokens=16", "triton"), {}, {})
  with unittest.mock.patch.object(registry, "target", lambda: h100):
    autotune_table.record(h100.device_kind, "rows", "bfloat16 D512 S128", entry, KernelOptions(stages=2))
    chosen = registry.rows(KernelOptions(stages=2), "bfloat16 D512 S128")
  assert chosen.name == "triton@block_d=256,block_tokens=16" and chosen.base == "triton"
  assert chosen.module is registry.by_name("rows", "triton").module and not chosen.row_order
  assert chosen.tiled(KernelOptions(stages=2)) == KernelOptions(stages=2, block_tokens=16, block_d=256)


def test_a_tiling_reaches_every_kernel_of_both_passes():
  """A record at a tiling hands its knobs to each kernel the forms compose (row_dots, row_accumulate, segment_sums,
  forward and backward), and the values are the implementation's own."""
  seen = []

  class Recording(Rows):  # XLA's kernels composed as the accelerators compose theirs
    def row_dots(self, *args):
      seen.append(("row_dots", args[-1].block_tokens, args[-1].block_d))
      return super().row_dots(*args)

    def row_accumulate(self, *args):
      seen.append(("row_accumulate", args[-1].block_tokens, args[-1].block_d))
      return super().row_accumulate(*args)

    def segment_sums(self, values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums=False):
      seen.append(("segment_sums", options.block_tokens, options.block_d))
      return super().segment_sums(values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums)

  kernels_only = types.SimpleNamespace(
    row_dots=xla.row_dots, row_accumulate=xla.row_accumulate, segment_sums=xla.segment_sums
  )
  plain = Recording("recording", None, module=kernels_only)
  tiled = registry.at_tiling("rows", plain, "block_tokens=16,block_d=256")
  x, w_in, w_out, rows, gates, bias = gather_case(0, 1, 6, 2, 2, 3, 32)

  def grads(implementation):
    fn = lambda *a: gated_gather(*a[:3], rows, a[3], options=KernelOptions("triton"), implementation=implementation)  # noqa: E731
    return jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=(0, 1, 2, 3))(x, w_in, w_out, gates)

  want = grads(plain)
  seen.clear()
  got = grads(tiled)
  assert {name for name, *_ in seen} == {"row_dots", "row_accumulate", "segment_sums"}, seen
  assert all((tokens, d) == (16, 256) for _, tokens, d in seen), seen
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)


def test_a_tiling_is_named_by_knob_and_integer():
  with pytest.raises(ValueError, match="tiling 'block_tokens=x' is not knob=integer"):
    registry.by_name("rows", "triton@block_tokens=x")
  with pytest.raises(ValueError, match=r"a tiling sets .* not \['warps'\]"):
    registry.by_name("rows", "triton@warps=4")
  with pytest.raises(ValueError, match="only the row kernels take a tiling"):
    registry.by_name("grouped_matmul", "triton@block_d=64")
  h100 = TracedDevice("gpu", "NVIDIA H100 80GB HBM3", 132)
  with unittest.mock.patch.object(registry, "target", lambda: h100):
    assert "triton@block_tokens=16" in autotune.specs_for("rows", tilings=True)
    assert not any("@" in spec for spec in autotune.specs_for("rows"))


@pytest.mark.slow
def test_a_second_process_reads_the_table_and_measures_nothing(table):
  """sparsetx-autotune on a micro sgatlin step: the first run measures each op call the step makes, its children
  spawned with preallocation off; the second finds them all in the table. A table that cannot be read, or written,
  ends in one `error:` line (exit 2, exit 5) naming it, and the table already there is untouched."""
  command = [
    sys.executable,
    "-m",
    "sparsetx.tools.autotune",
    "--config=configs/tiny.py",
    *MICRO_TRAIN_FLAGS,
    "--implementations=xla,autotune_fakes:REPORTS_ENVIRONMENT",
    "--rounds=1",
  ]
  env = {key: value for key, value in os.environ.items() if key != autotune.PREALLOCATE}
  first = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
  assert first.returncode == 0, first.stderr[-3000:]
  measured = [line for line in first.stdout.splitlines() if line.startswith("  rows ")]
  assert measured and all("chose xla" in line for line in measured), first.stdout
  assert all("raised: XLA_PYTHON_CLIENT_PREALLOCATE=false" in line for line in measured), first.stdout
  second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
  assert second.returncode == 0, second.stderr[-3000:]
  assert f"{len(measured)} op shapes in the step, 0 to measure" in second.stdout, second.stdout
  assert not [line for line in second.stdout.splitlines() if line.startswith("  rows ")]

  saved = table.read_text()
  unwritable = dict(env, **{autotune_table.ENV: str(table / "autotune.json")})  # under a regular file
  refused = subprocess.run([*command, "--again"], cwd=REPO, capture_output=True, text=True, timeout=300, env=unwritable)
  assert refused.returncode == 5 and refused.stderr.count("\n") == 1, refused.stderr[-3000:]
  assert refused.stderr.startswith(f"error: writing the autotune table {table}/autotune.json failed"), refused.stderr
  assert "measuring" not in refused.stdout and table.read_text() == saved
  table.write_text(saved[: len(saved) // 2])
  corrupt = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
  assert corrupt.returncode == 2 and corrupt.stderr.count("\n") == 1, corrupt.stderr[-3000:]
  assert corrupt.stderr.startswith(f"error: the autotune table {table} cannot be read"), corrupt.stderr


def test_a_child_past_its_time_is_timed_out_not_faulted(table, monkeypatch):
  monkeypatch.setattr(autotune, "CHILD_TIMEOUT_S", 5)
  measured = autotune.measure("rows", "autotune_fakes:HANGS", CALL, KernelOptions(), 1)
  assert measured.ms is None and measured.why == "timed out: no answer in 5 s", measured


def test_what_a_device_runs_is_one_list(table):
  """A CPU measures XLA's two designs (no kernel in interpret mode unless named); an H100 its GPU kernels and XLA's,
  never the TPU's; XLA (the reference) first."""
  assert autotune.specs_for("rows") == ["xla", "xla_row_order"]
  assert autotune.specs_for("grouped_matmul") == ["xla"]
  h100 = TracedDevice("gpu", "NVIDIA H100 80GB HBM3", 132)
  with unittest.mock.patch.object(registry, "target", lambda: h100):
    specs = autotune.specs_for("rows")
  assert specs[0] == "xla" and {"mosaic", "triton", "triton_row_order", "xla_row_order"} <= set(specs), specs
  assert not any(spec.startswith("tpu") for spec in specs), specs


def test_the_key_holds_the_device_kind_and_the_jax_version(table, monkeypatch):
  entry = autotune_table.Entry(("xla",), {}, {"xla": 1.0})
  autotune_table.record("NVIDIA H100 80GB HBM3", "rows", "bfloat16 D512 S128", entry)
  assert autotune_table.lookup("NVIDIA H100 80GB HBM3", "rows", "bfloat16 D512 S128") == entry
  assert autotune_table.lookup("NVIDIA H200", "rows", "bfloat16 D512 S128") is None
  monkeypatch.setattr(jax, "__version__", "0.0.1")
  assert autotune_table.lookup("NVIDIA H100 80GB HBM3", "rows", "bfloat16 D512 S128") is None


def test_a_call_the_table_lacks_takes_the_nearest_token_count(table):
  """An evaluation's batch takes what the train step's batch measured; another width or gating does not."""
  step = autotune_table.Entry(("triton", "xla"), {}, {"triton": 1.0, "xla": 2.0})
  small = autotune_table.Entry(("xla", "triton"), {}, {"triton": 2.0, "xla": 1.0})
  for tokens, entry in ((16384, step), (128, small)):
    call = dict(CALL, tokens=tokens)
    autotune_table.record("gpu", "rows", op_calls.shape_class(call), entry)
  near = lambda **fields: autotune_table.lookup(  # noqa: E731
    "gpu", "rows", op_calls.shape_class(dict(CALL, **fields)), nearest=True
  )
  assert near(tokens=8192) == step and near(tokens=256) == small
  assert near(tokens=8192, activation="gelu_tanh") is None and near(tokens=8192, d_model=64) is None
  assert autotune_table.lookup("gpu", "rows", op_calls.shape_class(dict(CALL, tokens=8192))) is None  # exact only


def test_an_entry_with_nothing_usable_falls_back_to_the_default_order_and_is_kept(table, caplog):
  """All dropped, or XLA itself failed: `auto` takes DEFAULT_ORDER (one warning), never a blocked call, and the
  autotuner keeps the verdict (a start does not measure it again; sparsetx-autotune --again does)."""
  h100 = TracedDevice("gpu", "NVIDIA H100 80GB HBM3", 132)
  none_ran = autotune_table.Entry((), {"triton": "faulted: killed by SIGILL", "xla": "timed out"}, {})
  xla_failed = autotune_table.Entry(("triton",), {"xla": "raised: out of memory"}, {"triton": 1.0})
  fine = autotune_table.Entry(("mosaic", "xla"), {"triton": "wrong values: 3 times the bound"}, {})
  calls = {}
  with (
    unittest.mock.patch.object(registry, "target", lambda: h100),
    unittest.mock.patch.object(autotune, "target", lambda: h100),
  ):
    for d_model, entry in ((512, none_ran), (256, xla_failed), (128, fine)):
      call = dict(CALL, d_model=d_model)
      calls["rows", op_calls.shape_class(call)] = call
      autotune_table.record(h100.device_kind, "rows", op_calls.shape_class(call), entry)
    chosen = [registry.rows(KernelOptions(), key, call).name for (_, key), call in calls.items()]
    assert chosen == ["triton", "triton", "mosaic"]
    assert autotune.missing(calls, KernelOptions()) == {}
  warnings = [r.getMessage() for r in caplog.records if "no usable ranking" in r.getMessage()]
  assert len(warnings) == 2 and "default order" in warnings[0], warnings


def test_a_table_that_cannot_be_read_is_one_sentence_and_off_reads_nothing(table):
  table.write_text('{"entries": {"k": {"ranking": 3')
  h100 = TracedDevice("gpu", "NVIDIA H100 80GB HBM3", 132)
  with unittest.mock.patch.object(registry, "target", lambda: h100):
    with pytest.raises(ConfigError, match=f"the autotune table {table} cannot be read .*delete it"):
      registry.rows(KernelOptions(), "bfloat16 D512 S128")
    with autotune_table.off():  # config.train.autotune=False
      assert registry.rows(KernelOptions(), "bfloat16 D512 S128").name == "triton"
      with pytest.raises(RuntimeError, match="nothing may be recorded"):
        autotune_table.record(h100.device_kind, "rows", "x", autotune_table.Entry((), {}, {}))
  assert table.read_text() == '{"entries": {"k": {"ranking": 3'


def test_a_gpu_parent_that_preallocates_spawns_no_candidate(table, monkeypatch):
  """A process holding 75% of a GPU would starve every child: the autotuner refuses to spawn from it."""
  h100 = TracedDevice("gpu", "NVIDIA H100 80GB HBM3", 132)
  monkeypatch.delenv(autotune.PREALLOCATE, raising=False)
  monkeypatch.setattr(autotune, "target", lambda: h100)
  spawned = []
  monkeypatch.setattr(autotune, "measure", lambda *a: spawned.append(a))
  with pytest.raises(ConfigError, match="XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX starts"):
    autotune.tune("rows", "k", CALL, KernelOptions(), ["xla"])
  assert not spawned
  autotune.leave_device_memory_to_children()
  assert os.environ[autotune.PREALLOCATE] == "false"


@pytest.mark.parametrize("ffn_type", ["sgatlin", "peer", "fff"])
def test_the_autotuner_records_the_steps_own_calls(ffn_type):
  """One trace of the train step on one device: each call holds the step's tokens (8 x 16, not the init's one
  sequence), the layer's dtypes, activation, gate placement and bias; FFF's walk is its own call."""
  config = load_config("configs/tiny.py", ffn_type)
  config.data.update(global_batch_size=8, seq_len=16)
  config.model.update(max_len=16, n_layers=1)
  config = config_lib.validate(config)
  calls = step_kernels.step_calls(config, state_lib.setup(config, devices=jax.devices()[:1]))
  forms = {}
  for (op, key), call in calls.items():
    assert op == "rows" and key == op_calls.shape_class(call) and call["tokens"] == 8 * 16, (key, call)
    forms[call["form"]] = call
  gather = forms.pop("gather")
  want = {
    "sgatlin": ("identity", True, False, False),
    "peer": ("gelu_tanh", False, False, False),
    "fff": ("gelu", False, True, True),
  }[ffn_type]
  assert (gather["activation"], gather["gate_inside"], gather["bias"], gather["given_h"]) == want, gather
  assert gather["dtype"] == config.model.dtype and gather["table_dtype"] == config.model.param_dtype
  assert set(forms) == ({"walk"} if ffn_type == "fff" else set()), forms


def test_a_corrupt_table_stops_a_gpu_step_as_one_config_error(table):
  """The trainer and the dry run trace the step under `auto` for a GPU: an unreadable table is the ConfigError their
  programs end in one `error:` line (exit 2), raised before anything compiles, never a traceback."""
  from sparsetx.measure import aot

  table.write_text('{"entries": ')
  config = load_config("configs/tiny.py", "sgatlin")
  config.model.update(d_model=128, n_layers=1, head_dim=64, max_len=64, dtype="bfloat16")
  config.data.update(seq_len=64, global_batch_size=2, eval_batch_size=2)
  with pytest.raises(ConfigError, match=f"the autotune table {table} cannot be read"):
    aot.lower_train_step(config_lib.validate(config), "h100:1x1x1")


@pytest.mark.parametrize("form", ["fff gather", "walk"])
def test_each_form_of_call_is_made_again_and_checked(form):
  """The autotuner repeats FFF's gather (exact GELU outside the gate, bias, given pre-activations) and FFF's walk
  (small integers: the paths must be equal), and checks a second implementation against XLA's. (MoE's grouped
  matmul against ragged_dot with ragged groups: tests/test_autotune_checks.py.)"""
  spec = jax.ShapeDtypeStruct
  x, f32 = spec((64, 32), jnp.float32), jnp.float32
  op, other, call = {
    "fff gather": (
      "rows",
      "xla_row_order",
      op_calls.gather(x, spec((30, 32), f32), f32, 4, op_calls.ACTIVATIONS["gelu"], False, True, True, False),
    ),
    "walk": ("rows", "xla_row_order", op_calls.walk(x, spec((2, 15, 32), f32), 2, 2)),
  }[form]
  measured = autotune.measure_here(op, other, call, KernelOptions(), 1)
  assert measured.why is None and measured.ms > 0, measured


def test_a_workdirs_copy_fills_a_fresh_hosts_table_and_the_hosts_own_entries_win(table, tmp_path):
  """A restart in a fresh container (an empty ~/.cache) takes the choices its workdir's run measured."""
  workdir = epath.Path(tmp_path / "run")
  workdir.mkdir()
  measured, own = autotune_table.Entry(("triton", "xla"), {}, {}), autotune_table.Entry(("xla",), {}, {})
  for shape_class in ("float32 D32 S4", "float32 D64 S4"):
    autotune_table.record("NVIDIA H100", "rows", shape_class, measured)
  autotune_table.keep_in(workdir)
  table.unlink()  # the next host
  autotune_table.record("NVIDIA H100", "rows", "float32 D64 S4", own)
  assert autotune_table.take_from(workdir) == 1
  assert autotune_table.lookup("NVIDIA H100", "rows", "float32 D32 S4") == measured
  assert autotune_table.lookup("NVIDIA H100", "rows", "float32 D64 S4") == own
  assert autotune_table.take_from(workdir) == 0
  (workdir / autotune_table.WORKDIR_COPY).write_text('{"entries": {"x": {"ranking": 3}}}')
  with pytest.raises(ConfigError, match=r"the autotune table's copy .*autotune.json cannot be read \(TypeError"):
    autotune_table.take_from(workdir)

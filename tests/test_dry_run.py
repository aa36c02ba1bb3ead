"""Dry run (sparsetx/measure/aot.py, sparsetx/tools/dry_run.py): per-device bytes, compiled step report, large configs."""

import math
import re

import jax
import pytest
from conftest import load_config

from sparsetx import config as config_lib
from sparsetx import hardware
from sparsetx.measure import aot
from sparsetx.models.ffn import placement
from sparsetx.parallel import logical_rules
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.plan import targets


def micro_config(ffn_type):
  config = load_config("configs/tiny.py", ffn_type)
  config.model.update(d_model=32, n_layers=2, head_dim=32, max_len=16, dtype="float32")
  config.model.ffn.update(
    dict(
      sgatlin=dict(n_channels=8, d_ffw=64, top_k=2, d_key=8),
      fff=dict(n_trees=8, depth=2),
      moe=dict(n_experts=8, d_ffw=16),
    )[ffn_type]
  )
  config.data.update(seq_len=16, global_batch_size=8, eval_batch_size=8)
  return config


def table_params(model) -> int:
  """The sparse tables' parameter count, by hand from the config."""
  ffn, D, L = model.ffn, model.d_model, model.n_layers
  if ffn.type == "sgatlin":
    return L * 2 * ffn.n_channels * ffn.d_ffw * D
  if ffn.type == "fff":
    return L * 2 * ffn.n_trees * (2 ** (ffn.depth + 1) - 1) * D
  return L * 3 * ffn.n_experts * D * ffn.d_ffw


@pytest.mark.parametrize("ffn_type", ["sgatlin", "fff", "moe"])
def test_table_bytes_per_device_fall_as_one_over_expert(ffn_type):
  config = micro_config(ffn_type)
  rows = aot.table_bytes_by_expert(config, jax.devices(), [1, 2, 4, 8])
  total = 4 * table_params(config.model)
  assert rows == [(expert, total // expert) for expert in (1, 2, 4, 8)]


def test_dry_run_reports_the_compiled_step():
  config = micro_config("sgatlin")
  config.mesh.ici.update(data=2, expert=4)
  mesh = mesh_lib.make_mesh(config.mesh)
  report = aot.dry_run(config, mesh)
  abstract, _, _, _ = aot.abstract_state(config, mesh)
  assert report.n_params == sum(math.prod(p.shape) for p in jax.tree.leaves(abstract.params))
  assert report.table_bytes == 4 * table_params(config.model) // 4
  assert report.optimizer_bytes >= 2 * report.param_bytes  # Adam's two moments, sharded like the params
  assert report.memory["argument"] >= report.param_bytes + report.optimizer_bytes
  assert report.memory["temp"] > 0 and report.compiled_flops > 0
  assert (
    report.bytes_accessed >= report.memory["argument"] and report.tokens_per_step == 8 * 16
  )  # reads every input once
  assert report.model_flops > report.compiled_flops  # the model's work is spread over 8 devices
  ops = {(c.op, c.group) for c in report.collectives}
  # the sgatlin layers' shard_map: tokens gathered, indices to owners, outputs reduce-scattered over expert=4
  assert {("all-gather", 4), ("all-to-all", 4), ("reduce-scatter", 4)} <= ops
  # the sparse layers' forward moves tokens, never tables: each transfer is below one layer's table shard
  forward = [c for c in report.collectives if c.source.startswith("jit(train_step)/jvp(") and "/mlp/" in c.source]
  assert forward and max(c.nbytes for c in forward) < report.table_bytes / config.model.n_layers / 2
  text = aot.format_report(report)
  assert "reduce-scatter" in text and "data=2 x fsdp=1 x tensor=1 x expert=4" in text


def test_channels_that_do_not_split_over_expert_are_refused():
  """Under placement expert; placement auto takes one that runs instead (fsdp or data: the channels stay whole)."""
  config = micro_config("sgatlin")
  config.model.ffn.n_channels = 4
  config.mesh.ici.update(data=1, expert=8)
  abstract, _, _, _ = aot.abstract_state(config, mesh_lib.make_mesh(config.mesh))
  specs = [leaf.sharding.spec for path, leaf in jax.tree.leaves_with_path(abstract.params) if "experts" in str(path)]
  assert specs and all(spec[1] is None for spec in specs)
  config.model.ffn.placement = "expert"
  with pytest.raises(
    config_lib.ConfigError,
    match=r"config.model.ffn.n_channels=4 is not divisible by the 8 devices"
    r".*split the table's d_model over those devices instead",
  ):
    aot.abstract_state(config, mesh_lib.make_mesh(config.mesh))
  config.model.ffn.n_channels = 6  # neither divides the other: no d_model split either
  with pytest.raises(config_lib.ConfigError, match=r"n_channels=6 is not divisible by the 8 devices.*fsdp\.$"):
    aot.abstract_state(config, mesh_lib.make_mesh(config.mesh))


def test_d_model_split_spreads_few_channels_over_more_devices():
  """C=4 channels on expert=8 with the d_model split rules: the tables fall to 1/8 per device."""
  config = micro_config("sgatlin")
  config.model.ffn.n_channels = 4
  config.mesh.ici.update(data=1, expert=8)
  config.mesh.rules = logical_rules.D_MODEL_SPLIT_RULES + config_lib.DEFAULT_RULES
  abstract, _, _, _ = aot.abstract_state(config, mesh_lib.make_mesh(config.mesh))
  assert aot.sparse_table_bytes(abstract.params) == 4 * table_params(config.model) // 8
  specs = [leaf.sharding.spec for path, leaf in jax.tree.leaves_with_path(abstract.params) if "experts" in str(path)]
  assert specs and all(tuple(spec) == (None, None, None, ("fsdp", "expert")) for spec in specs)


def test_d_model_that_does_not_split_is_refused():
  config = micro_config("sgatlin")
  config.model.d_model = 20
  config.mesh.rules = logical_rules.D_MODEL_SPLIT_RULES + config_lib.DEFAULT_RULES
  mesh = jax.sharding.AbstractMesh((1, 1, 1, 8), config_lib.MESH_AXES)
  with pytest.raises(config_lib.ConfigError, match=r"config.model.d_model=20 is not divisible by the 8 devices"):
    placement.check_units_divide(config, mesh)


@pytest.mark.parametrize("arg, mesh_shape", [("sgatlin8,h100", (8, 1, 1, 8)), ("sgatlin4b,v5p", (4, 1, 1, 16))])
def test_large_configs_pass_the_replication_check(arg, mesh_shape):
  config = load_config("configs/large.py", arg)
  config_lib.validate(config)
  assert config.mesh.ici.expert == mesh_shape[3]
  mesh = jax.sharding.AbstractMesh(mesh_shape, config_lib.MESH_AXES)
  abstract, _, _, _ = aot.abstract_state(config, mesh)  # raises if a large parameter would be replicated
  n_params = sum(math.prod(p.shape) for p in jax.tree.leaves(abstract.params))
  assert n_params > (6e9 if arg.startswith("sgatlin8") else 4e9)
  assert aot.sparse_table_bytes(abstract.params) == 4 * table_params(config.model) // mesh_shape[3]


def test_a_topologys_chip_sizes_what_may_stay_replicated():
  """configs/ladder.py:sgatlin,3 on h100:1x1x4 replicates its 74 MiB embedding on 4 data-parallel GPUs: the default
  limit (64 MiB) refused it; the H100 sizes the limit as a target would (1/512 of its 80 GB), and the check passes."""
  config = load_config("configs/ladder.py", "sgatlin,3")
  config.mesh.ici.update(data=4, fsdp=1, tensor=1, expert=1)
  mesh = jax.sharding.AbstractMesh((4, 1, 1, 1), config_lib.MESH_AXES)
  with pytest.raises(config_lib.ConfigError, match=r"\['embed'\]\['embedding'\] \(74 MiB\) would be fully replicated"):
    aot.abstract_state(config_lib.validate(config.copy_and_resolve_references()), mesh)
  targets.size_replication_limit(config, hardware.CHIPS["h100"])
  assert config.mesh.max_replicated_mib == pytest.approx(80e9 / 512 / 2**20)
  aot.abstract_state(config_lib.validate(config), mesh)


def test_dry_run_tool_prints_the_projected_step_time_per_target():
  """python -m sparsetx.tools.dry_run on the micro sgatlin model: the roofline table has a row per chip, each with a finite step."""
  import subprocess
  import sys

  from conftest import MICRO_SGATLIN_FLAGS, REPO

  micro = [*MICRO_SGATLIN_FLAGS, "--config.model.dtype=float32"]
  result = subprocess.run(
    [sys.executable, "-m", "sparsetx.tools.dry_run", "--config=configs/tiny.py:sgatlin", "--devices=8", *micro],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  compiled, analytic = result.stdout.split("projected step time, analytic")
  rows = [line.split() for line in compiled.splitlines() if line.startswith(("  H100", "  H200", "  TPU"))]
  assert [" ".join(r[:2]) for r in rows] == ["H100 SXM", "H200 SXM", "TPU v5p", "TPU v6e"]
  for row in rows:
    compute, memory, comm, overlap = (float(v) for v in row[2:6])
    assert overlap == pytest.approx(max(compute, memory, comm), rel=1e-2) and overlap > 0  # printed to 3 digits
    assert float(row[8]) == pytest.approx(max(compute, memory) + comm, rel=1e-2)
  # the per-layer analytic table (sparsetx/plan/layer_cost.py) and the step projected from it
  assert "sgatlin feed-forward (layers 0..1; per layer and device, 16 tokens" in compiled
  assert "  gather fwd row_dots " in compiled and "  HBM-bound share of the layer time" in compiled
  rows = [line.split() for line in analytic.splitlines() if line.startswith(("  H100", "  H200", "  TPU"))]
  assert [" ".join(r[:2]) for r in rows] == ["H100 SXM", "H200 SXM", "TPU v5p", "TPU v6e"]
  for row in rows:  # each phase at the slower of compute and memory: the sum is at least the larger total
    compute, memory, comm, overlap, serial = (float(v) for v in (*row[2:6], row[8]))
    assert overlap >= max(compute, memory, comm) * 0.99
    assert serial == pytest.approx(overlap + comm, rel=1e-2) if overlap > comm else serial >= overlap


def test_remat_sweep_full_remat_recomputes_the_forward():
  config = micro_config("fff")
  config.mesh.ici.update(data=8)
  rows = aot.remat_rows(config, mesh_lib.make_mesh(config.mesh), policies=("none", "full"))
  assert [policy for policy, _, _ in rows] == ["none", "full"]
  flops = {policy: f for policy, _, f in rows}
  assert all(temp > 0 for _, temp, _ in rows)
  # full remat runs each block's forward twice: more FLOPs than none, at most one more forward (1/3 of a step)
  assert flops["none"] < flops["full"] <= flops["none"] * (1 + 1 / 3) * 1.05


def run_dry_run(*args):
  import subprocess
  import sys

  from conftest import REPO

  return subprocess.run(
    [sys.executable, "-m", "sparsetx.tools.dry_run", *args], cwd=REPO, capture_output=True, text=True, timeout=600
  )


TINY_ON_4 = [
  "--config.model.n_layers=2",
  "--config.data.seq_len=128",
  "--config.model.max_len=128",
  "--config.data.global_batch_size=8",
  "--config.data.eval_batch_size=8",
  "--config.model.dtype=bfloat16",
  "--config.mesh.ici.data=4",
]


def test_dry_run_compiles_for_a_topology_with_its_compiler():
  """--topology=v6e:2x2: libtpu compiles the tiny FFF step; the compiler's memory, the loops and the kernels."""
  result = run_dry_run("--config=configs/tiny.py:fff", "--topology=v6e:2x2", *TINY_ON_4)
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "compiled for v6e:2x2 (TPU v6 lite, 4 devices)" in out
  assert re.search(r"peak [\d.]+ [KMG]iB of TPU v6e's [\d.]+ GiB HBM", out), out
  assert re.search(r"analytic estimate [\d.]+ [KMG]iB \([\d.]+ x the compiled peak\)", out), out
  kernels = {line.split()[1] for line in out.splitlines() if line.startswith("  tpu_custom_call")}
  assert {"row_dots", "row_accumulate", "segment_sums", "splash_mha_fwd_segmented_residuals"} <= kernels
  assert "loops of the compiled program (trips): 8, 8" in out  # the chunked loss's forward and backward


def test_a_gpu_topology_without_compiled_costs_is_projected_from_the_analytic_model():
  """--topology=a100:1x1x4: XLA reports no FLOPs for a deviceless GPU compile, so the step is projected from the
  analytic model (said in one line), with a step time and tokens/s above zero; the A100's links are priced."""
  result = run_dry_run("--config=configs/tiny.py:sgatlin", "--topology=a100:1x1x4", *TINY_ON_4)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert "compiled FLOPs per device 0.000e+00" in out  # the premise: the compiler counts nothing here
  assert "projected from the analytic model" in out
  row = next(line.split() for line in out.splitlines() if line.startswith("  A100 SXM"))
  overlap_ms, tokens_per_s = float(row[-6]), float(row[-5].replace(",", ""))
  assert overlap_ms > 0 and tokens_per_s > 0, row


@pytest.mark.parametrize(
  "topology, message",
  [
    ("rocm:1x1x8", "is neither a TPU topology"),
    ("v5p:3x3x3", "libtpu knows no TPU topology 'v5p:3x3x3'"),
    ("b200:1x1x8", "GPU target 'b200' is not described"),
  ],
)
def test_dry_run_refuses_an_unknown_topology_in_one_line(topology, message):
  result = run_dry_run("--config=configs/tiny.py:fff", f"--topology={topology}")
  assert result.returncode == 2
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and message in errors[0], result.stderr


def test_a_missing_compiler_is_named_with_what_to_install(monkeypatch):
  import importlib.util

  from sparsetx.parallel import topology

  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
  with pytest.raises(config_lib.ConfigError, match=r"needs libtpu: pip install 'jax\[tpu\]'"):
    topology.devices("v5p:2x2x1")


def test_a_refused_kernel_is_named_with_its_layer(monkeypatch):
  """A Mosaic refusal (here a 1-D window copy off the 128-element tiles of HBM, which PAIR_ALIGN prevents) is
  reported at the kernel and layer the compiler refused, found by compiling each kernel of the step alone."""

  config = load_config("configs/tiny.py", "sgatlin")
  config.model.update(d_model=128, n_layers=2, head_dim=64, max_len=128, dtype="bfloat16")
  config.data.update(seq_len=128, global_batch_size=8, eval_batch_size=8)
  config.mesh.ici.update(data=4)
  from sparsetx.kernels.rows import tpu

  monkeypatch.setattr(tpu, "PAIR_ALIGN", 8)
  mesh = aot.topology_mesh(config_lib.validate(config), "v5p:2x2x1")
  with pytest.raises(Exception) as refused:
    aot.compile_for_topology(config, "v5p:2x2x1")
  line = aot.describe_rejection(refused.value, "v5p:2x2x1", aot.rejected_kernel(config, mesh))
  assert re.match(r"the compiler for v5p:2x2x1 rejected the train step at layers_\d's segment_sums kernel: ", line)
  assert "Mosaic failed to compile TPU kernel" in line and "\n" not in line


# The save cadence (sparsetx/plan/save_cadence.py) through the program, without compiling ------------------------

LLAMA3_CHIP_MTBF_S = 54 * 24 * 16384 / 419 * 3600  # Llama 3 report, section 3.3.4: 419 interruptions, 54 days


def cadence_rows(out: str) -> dict:
  """{row label: [[value per chip count], ...]} of the printed save-cadence table, a list per label in the order
  printed ("its goodput" follows each interval)."""
  rows = {}
  for line in out.splitlines():
    match = re.match(r"  \s*(\S.*?)\s{2,}((?:[\d.,]+%?(?: (?:min|ms|s|h))?\s*)+)$", line)
    if match:
      rows.setdefault(match[1].strip(), []).append(re.findall(r"[\d.,]+%?(?: (?:min|ms|s|h))?", match[2]))
  return rows


def minutes(value: str) -> float:
  assert value.endswith(" min"), value
  return float(value[: -len(" min")])


def percent(value: str) -> float:
  assert value.endswith("%"), value
  return float(value[:-1]) / 100


def test_save_cadence_of_configs_large_at_1024_and_8192_chips_without_compiling():
  """The estimated table: M from Llama 3's per-chip rate, the numeric optimum beside Daly's and Young's (which
  agree to a hundredth of a minute at delta << M) and above both configured intervals' goodput, every figure
  labelled estimated, nothing compiled."""
  result = run_dry_run(
    "--config=configs/large.py:sgatlin8,h100", "--target=h100", "--chips=1024,8192", "--save_cadence_only"
  )
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "compiled in" not in out and "measured (" not in out
  rows = cadence_rows(out)
  assert rows["system MTBF M"] == [[f"{LLAMA3_CHIP_MTBF_S / n / 3600:.1f} h" for n in (1024, 8192)]]
  assert re.search(r"save delta: estimated \([\d.]+ GB of parameters and AdamW moments per device", out), out
  assert "restart R at 8,192 chips: estimated (" in out and "step time: estimated (" in out
  (by_time, by_steps, optimum) = rows["its goodput"]
  for i, chips in enumerate((1024, 8192)):
    save_s = float(rows["blocking save delta"][0][i].removesuffix(" ms")) / 1000  # printed to the ms
    young = math.sqrt(2 * save_s * LLAMA3_CHIP_MTBF_S / chips) / 60
    assert minutes(rows["Young's sqrt(2 delta M)"][0][i]) == pytest.approx(young, abs=0.011)
    optimal = minutes(rows["optimal every_minutes (numeric)"][0][i])
    assert optimal == pytest.approx(minutes(rows["Daly's closed form"][0][i]), abs=0.011)
    assert minutes(rows["configured every_minutes=15"][0][i]) == 15.0
    assert percent(optimum[i]) >= max(percent(by_time[i]), percent(by_steps[i]))


def test_save_cadence_from_a_workdirs_measured_costs(tmp_path):
  """A hand-written goodput.json: saves 0.5, 1.5, 1.0 s (delta = 1 s), restarts 20 and 30 s (R = 25 s), steps of
  0.25 s. The printed optimum, its steps and goodput, Daly's form and the configured 100 steps' goodput are those
  computed here, and the figures say measured."""
  import json

  costs = dict(save_seconds=[0.5, 1.5, 1.0], restore_seconds=[3.0], restart_seconds=[20.0, 30.0], step_seconds=0.25)
  (tmp_path / "goodput.json").write_text(json.dumps(dict(seconds={}, wall=100.0, runs=2, costs=costs)))
  result = run_dry_run(
    "--config=configs/large.py:sgatlin8,h100", f"--costs_from={tmp_path}", "--chips=1024,8192", "--save_cadence_only"
  )
  assert result.returncode == 0, result.stderr
  out = result.stdout
  rows = cadence_rows(out)
  assert rows["blocking save delta"] == [["1.00 s", "1.00 s"]]
  assert rows["restart R (init, restore, compile)"] == [["25.0 s", "25.0 s"]]
  assert f"save delta: measured (mean of 3 blocking save calls in {tmp_path}/goodput.json)" in out
  assert "estimated" not in out
  (_, by_steps, optimum) = rows["its goodput"]

  def daly_goodput(tau, mtbf):  # Daly's: tau / (M e^(R/M) (e^((tau + delta)/M) - 1)), delta = 1 s, R = 25 s
    return tau / (mtbf * math.exp(25.0 / mtbf) * math.expm1((tau + 1.0) / mtbf))

  for i, chips in enumerate((1024, 8192)):
    mtbf = LLAMA3_CHIP_MTBF_S / chips
    # The optimum by bisection on the stationary point of log goodput: d/dtau [log tau - log(e^((tau + delta)/M)
    # - 1)] = 0 where tau = M (1 - e^(-(tau + delta)/M)), below it to the left and above it to the right.
    lo, hi = 0.0, mtbf
    for _ in range(200):
      mid = (lo + hi) / 2
      lo, hi = (mid, hi) if mid < mtbf * (1 - math.exp(-(mid + 1.0) / mtbf)) else (lo, mid)
    assert minutes(rows["optimal every_minutes (numeric)"][0][i]) == pytest.approx(lo / 60, abs=0.006)
    assert int(rows["in steps"][0][i].replace(",", "")) == pytest.approx(lo / 0.25, abs=1)
    assert percent(optimum[i]) == pytest.approx(daly_goodput(lo, mtbf), abs=6e-6)
    x = math.sqrt(1.0 / (2 * mtbf))  # Daly's closed form, transcribed: sqrt(2 delta M) (1 + x/3 + x^2/9) - delta
    daly = math.sqrt(2 * mtbf) * (1 + x / 3 + x * x / 9) - 1.0
    assert minutes(rows["Daly's closed form"][0][i]) == pytest.approx(daly / 60, abs=0.006)
    assert minutes(rows["configured every=100 steps"][0][i]) == pytest.approx(25 / 60, abs=0.006)
    assert percent(by_steps[i]) == pytest.approx(daly_goodput(25.0, mtbf), abs=6e-6)


@pytest.mark.parametrize(
  "costs, words",
  [(dict(save_seconds=[1.0], restart_seconds=[]), "measured no restart"), (None, "holds no measured costs")],
)
def test_a_goodput_record_without_measurements_is_one_error_line(tmp_path, costs, words):
  import json

  record = dict(seconds={}, wall=1.0) if costs is None else dict(seconds={}, costs=costs)
  (tmp_path / "goodput.json").write_text(json.dumps(record))
  result = run_dry_run("--config=configs/large.py:sgatlin8,h100", f"--costs_from={tmp_path}", "--chips=1024")
  assert result.returncode == 2 and result.stdout == ""
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and words in errors[0] and f"{tmp_path}/goodput.json" in errors[0], result.stderr

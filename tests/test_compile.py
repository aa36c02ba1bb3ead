"""The train step compiled by each target's real compiler on this CPU-only machine (aot.compile_for_topology):
libtpu for TPU v5p and v6e, XLA's GPU compiler (Triton, Mosaic GPU, ptxas, cuDNN) for H100 and A100, over the
devices of a topology (parallel/topology.py). Lowering is not compiling: Mosaic checks a Pallas TPU kernel's tiling
and VMEM only here, and the compiler decides the loops, fusions and collectives a device runs.

Every feed-forward type compiles on every target with data=4, and each placement it supports (tables split by
expert, the d-split, fsdp, MoE by ragged all-to-all) and micro-batches compile on a TPU and a GPU. Each compiled
program is read for: the kernels it launches, its loops and their trip counts, where the gradient reductions sit
(each parameter's gradient reduced once per step, none inside the micro-batch loop), MoE's ragged all-to-alls and
their bytes, and bf16 payloads on the wire. Shapes are the smallest that take each kernel path (d_model 128, 128
tokens a row), with config.train.loss_chunks at its default; a compile takes 5 to 15 s.
"""

import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest
from conftest import load_config

from sparsetx import config as config_lib
from sparsetx import hardware
from sparsetx.kernels import autotune_table, registry
from sparsetx.kernels.fff import tree_route
from sparsetx.kernels.grouped_matmul.op import grouped_matmul
from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows.gated_gather import gated_gather
from sparsetx.measure import aot
from sparsetx.models import attention
from sparsetx.models.ffn.common import gelu_tanh
from sparsetx.models.ffn.product_keys import product_key_top_k
from sparsetx.models.ffn.registry import SPECS
from sparsetx.parallel import logical_rules
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.perf import hlo_text, roofline, step_parts
from sparsetx.plan import memory
from sparsetx.train import state as state_lib
from sparsetx.train import step_kernels

TOPOLOGIES = {"v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "h100": "h100:1x1x4", "a100": "a100:1x1x4"}
FFN_TYPES = ("mlp", "swiglu", "moe", "peer", "sgatlin", "fff")
GATHER_TYPES = ("peer", "sgatlin", "fff")
ROW_KERNELS = {"row_dots", "row_accumulate", "segment_sums"}
LOOP_TRIP_BOUND = 8  # the vocabulary tiles of the chunked loss; micro-batches; no loop grows with tokens
REDUCTIONS = ("all-reduce", "reduce-scatter")
GROUPED_KERNELS = {  # MoE's grouped matmul (kernels/grouped_matmul/op.py) per target
  "v5p": {"ragged-dot-none", "tgmm"},
  "v6e": {"ragged-dot-none", "tgmm"},
  "h100": {"mosaic_gpu", "grouped_matmul_t"},
  "a100": {"grouped_matmul", "grouped_matmul_t"},
}


def compile_config(ffn_type: str, **ici):
  config = load_config("configs/tiny.py", ffn_type)
  config.model.update(d_model=128, n_layers=2, head_dim=64, max_len=128, dtype="bfloat16")
  config.data.update(seq_len=128, global_batch_size=8, eval_batch_size=8)
  config.mesh.ici.update(data=1, fsdp=1, tensor=1, expert=1)
  config.mesh.ici.update(**(ici or dict(data=4)))
  return config


class Compiled(NamedTuple):
  text: str  # the optimized program
  built: object  # state_lib.Setup
  report: aot.Report
  mesh: object
  config: object


def compiled(config, target) -> Compiled:
  program, built, mesh = aot.compile_for_topology(config_lib.validate(config), TOPOLOGIES[target])
  return Compiled(program.as_text(), built, aot.report_of(program, built, config, mesh), mesh, config)


def kernels(text) -> dict:
  """{kernel: count} the program launches: Pallas kernels by name ('mosaic_gpu' for Mosaic GPU's unnamed calls),
  'cudnn' for cuDNN's fused attention."""
  found = {}
  for (target, name), count in hlo_text.compiled_kernels(text).items():
    key = "mosaic_gpu" if target.startswith("mosaic_gpu") else "cudnn" if target.startswith("__cudnn") else name
    if target.startswith(("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu", "__cudnn")):
      found[key] = found.get(key, 0) + count
  return found


def reduced_elements(text) -> tuple[int, int]:
  """(gradient-like elements reduced per step, those reduced inside the micro-batch loop): every reduction counted
  once per trip of the loops around it (a loop body's collectives run every trip)."""
  loops = hlo_text.compiled_loops(text)
  trips = {loop.body: loop.trips or 1 for loop in loops}
  per_step = in_microbatch_loop = 0
  for name, found in hlo_text.collectives_by_computation(text).items():
    for c in found:
      if c.op not in REDUCTIONS:
        continue
      n = c.elements * (c.group if c.op == "reduce-scatter" else 1)  # a reduce-scatter's input
      per_step += n * trips.get(name, 1)
      in_microbatch_loop += n if trips.get(name) == 2 else 0
  return per_step, in_microbatch_loop


SCALARS = 128  # the loss and token sums and the layers' scalar statistics (MoE: its load and balancing values)


def reduction_budget(built) -> tuple[int, int]:
  """(parameters, the most elements beyond them a step may reduce): each gradient once, plus the scalars, the
  sparse layers' usage counts (sparse_stats.py, one per unit and layer) and, for FFF, its dense top levels' weight
  gradients a second time. Those levels (tree_route.DENSE_LEVELS) are a bf16 einsum over the device's tokens: the
  compiler reduces their bf16 gradient [P, 2**top - 1, D] first, then the whole float32 table gradient, whose top
  rows the deep levels' segment sums leave zero (7 of 31 nodes of each table at depth 4: a known double cost)."""
  model_cfg = built.model.cfg
  n_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(built.abstract_state.params))
  ffn = model_cfg.ffn
  spec = SPECS[ffn.type]
  extra = SCALARS + (model_cfg.n_layers * spec.circuit.usage_units(ffn) if spec.circuit is not None else 0)
  if ffn.type == "fff":
    top = 2 ** min(tree_route.DENSE_LEVELS, ffn.depth + 1) - 1
    extra += model_cfg.n_layers * 2 * ffn.n_trees * top * model_cfg.d_model
  return n_params, extra


# The analytic device estimate over the compiler's peak, on every compiled case. Measured 2026-12-04 at these shapes
# (peaks of 7 to 99 MiB): 0.70-1.02 on H100 and A100, 0.24-0.87 on TPU (the sparse kernels' padded 128-token groups
# per core and their uint32 copies of the bf16 tables are not in the model); MoE by grouped matmuls 0.92-1.02 on
# the GPUs and 0.46-0.72 on TPU (before them, with every pair of the batch on every device: 0.18-0.64).
ANALYTIC_RATIO = (0.15, 1.5)


def assert_analytic_memory_near_the_compilers(step: Compiled):
  """The planner's analytic estimate (plan/memory.device_memory: state, gradients, saved activations, one block's
  backward, one vocabulary tile of the loss) stays within ANALYTIC_RATIO of the compiled program's peak. It omits
  the compiler's fusion scratch and the kernels' padding, and counts residuals the compiler may rematerialize, so
  neither side bounds the other exactly; the dry run prints both."""
  ratio = memory.device_memory(step.config, step.mesh, step.report).device / step.report.peak_bytes
  assert ANALYTIC_RATIO[0] <= ratio <= ANALYTIC_RATIO[1], (ratio, step.report.memory)


def expected_attention(target) -> set:
  return {"cudnn"} if target in ("h100", "a100") else {"splash_mha_fwd_segmented_residuals"}


def assert_sparse_kernels(found: dict, ffn_type: str, target: str, mosaic_rows: bool = False):
  if ffn_type == "moe":
    assert GROUPED_KERNELS[target] <= set(found) and not ROW_KERNELS & set(found), found
  elif ffn_type not in GATHER_TYPES:
    assert not ROW_KERNELS & set(found) and "mosaic_gpu" not in found, found
  elif mosaic_rows:  # kernel.implementation=mosaic on Hopper: two layers' forward, backward and table gradients
    assert found.get("mosaic_gpu", 0) >= 12 and not ROW_KERNELS & set(found), found
  else:  # Triton on GPUs (kernel.implementation=auto: registry.DEFAULT_ORDER), Mosaic TPU on TPU
    assert ROW_KERNELS <= set(found), found


# The parts (perf/step_parts.py) a row kernel's launches may fall in: FFF's walk takes its levels' logits by row_dots.
ROW_KERNEL_PARTS = {
  "row_dots": {"row gathers", "ffn router + top-k"},
  "row_order_dots": {"row gathers", "ffn router + top-k"},
  "row_accumulate": {"row gathers"},
  "fused_forward": {"row gathers"},
  "segment_sums": {"table grads: segment sums", "table grads: combine"},
}


def assert_row_kernels_in_their_parts(text, found: dict):
  """The compiled breakdown (step_parts.compiled_parts, sparsetx-bench-step-parts --topology) puts every row kernel
  the program launches in its part: the named scopes reach the target's compiled kernels."""
  parts = {}
  for launch in hlo_text.launches(text):
    name = re.search(r"(\w+)\)*/pallas_call$", launch.op_name)
    if name and name[1] in ROW_KERNEL_PARTS:
      parts.setdefault(name[1], set()).add(step_parts.part_of(launch.op_name))
  assert set(parts) == set(ROW_KERNEL_PARTS) & set(found), (parts, found)
  assert all(parts[name] <= ROW_KERNEL_PARTS[name] for name in parts), parts


def assert_loops_bounded(text):
  loops = hlo_text.compiled_loops(text)
  assert all(loop.trips is not None and loop.trips <= LOOP_TRIP_BOUND for loop in loops), loops


def assert_data_parallel_step(step: Compiled, ffn_type: str, target: str):
  """data=4: every parameter is replicated, so each step reduces exactly its parameters' gradient elements once
  (how the compiler combines or reshapes them does not matter), plus a few scalars (loss, token count)."""
  found = kernels(step.text)
  assert_sparse_kernels(found, ffn_type, target)
  assert_row_kernels_in_their_parts(step.text, found)
  assert expected_attention(target) <= set(found), found
  assert_loops_bounded(step.text)
  assert_analytic_memory_near_the_compilers(step)
  per_step, _ = reduced_elements(step.text)
  n_params, extra = reduction_budget(step.built)
  assert n_params <= per_step <= n_params + extra, (per_step, n_params, extra)


@pytest.mark.parametrize("target", list(TOPOLOGIES))
@pytest.mark.parametrize("ffn_type", [t for t in FFN_TYPES if t != "moe"])  # MoE: test_moe_compiles_...
def test_train_step_compiles_with_its_kernels_and_one_gradient_reduction(ffn_type, target):
  assert_data_parallel_step(compiled(compile_config(ffn_type), target), ffn_type, target)


# MoE at a shape where routing matters: 16 experts, 4 per token, 1,024 tokens a device, so 4,096 (token, slot)
# pairs a device. Rolled out (every expert over every pair: kernel.implementation=xla on a GPU) the step's
# temporaries were 477 MiB on H100 against 66 MiB on v5p; by grouped matmuls 33 MiB on H100, 28 on A100.
MOE_SHAPE = dict(n_experts=16, experts_per_token=4, d_ffw=256)
MOE_TOKENS_PER_DEVICE = 1024
MOE_TEMP_FACTOR = 1.5  # a GPU step's temporaries over the v5p step's, at most


@pytest.mark.long  # a system case of half a minute or more: make test-long
@pytest.mark.slow
def test_moe_compiles_at_the_routed_cost():
  """MoE with data=4 on every target: each device sorts and computes its own pairs by grouped matmuls (native
  ragged dots and megablox tgmm on TPU, Mosaic GPU and Triton on H100, Triton on A100), so no buffer's shape
  carries both the expert count and the device's pairs, and a GPU's temporaries stay within MOE_TEMP_FACTOR of
  the TPU program's. Plus everything the other types' data-parallel steps hold (one gradient reduction)."""
  temps = {}
  for target in TOPOLOGIES:
    config = compile_config("moe")
    config.model.ffn.update(**MOE_SHAPE)
    config.data.update(global_batch_size=4 * MOE_TOKENS_PER_DEVICE // config.data.seq_len)
    step = compiled(config, target)
    assert_data_parallel_step(step, "moe", target)
    pairs = str(MOE_TOKENS_PER_DEVICE * MOE_SHAPE["experts_per_token"])
    rolled_out = {
      d for d in re.findall(r"\[([\d,]+)\]", step.text) if {str(MOE_SHAPE["n_experts"]), pairs} <= set(d.split(","))
    }
    assert not rolled_out, (target, rolled_out)
    temps[target] = step.report.memory["temp"]
  for gpu in ("h100", "a100"):
    assert temps[gpu] <= MOE_TEMP_FACTOR * temps["v5p"], temps


@pytest.mark.parametrize("target", list(TOPOLOGIES))
def test_grouped_matmul_compiles_to_the_routed_flops(target):
  """The grouped matmul with both gradients, alone: 2,048 bf16 rows, 16 groups, K = 256, N = 512. Its kernels
  launch, no buffer carries both the group count and the rows, and where the compiler counts FLOPs (libtpu; a
  GPU's kernels are opaque to XLA's cost analysis) they are within 1.25x of three matmuls' 2 * rows * K * N
  (ragged_dot's own gradient on TPU, rolled out over every group, counted 6x)."""
  S, K, N, E = 2048, 256, 512, 16
  spec = jax.ShapeDtypeStruct

  def loss_and_grads(lhs, rhs, sizes):
    loss = lambda x, w: jnp.sum(grouped_matmul(x, w, sizes, KernelOptions()).astype(jnp.float32))  # noqa: E731
    return jax.value_and_grad(loss, argnums=(0, 1))(lhs, rhs)

  with aot.on_topology(TOPOLOGIES[target]):
    program = (
      jax.jit(loss_and_grads)
      .trace(spec((S, K), jnp.bfloat16), spec((E, K, N), jnp.float32), spec((E,), jnp.int32))
      .lower()
      .compile()
    )
  text = program.as_text()
  assert GROUPED_KERNELS[target] <= set(kernels(text)), kernels(text)
  assert not [d for d in re.findall(r"\[([\d,]+)\]", text) if {str(E), str(S)} <= set(d.split(","))]
  costs = program.cost_analysis()
  flops = (costs or {}).get("flops", 0.0)
  if target in ("v5p", "v6e"):
    assert 0 < flops <= 1.25 * 3 * 2 * S * K * N, flops


PLACEMENTS = [  # (ffn type, mesh, placement, d-split rules)
  ("sgatlin", dict(data=1, expert=4), "expert", False),
  ("sgatlin", dict(data=2, fsdp=2), "fsdp", False),
  ("sgatlin", dict(data=1, expert=4), "expert", True),
  ("fff", dict(data=1, expert=4), "expert", False),
  ("moe", dict(data=1, expert=4), "auto", False),
]
# make test compiles every placement for v5p and the first for the H100 too; make test-long the rest for the H100.
PLACEMENT_TARGETS = [
  *[(*placement, "v5p") for placement in PLACEMENTS],
  (*PLACEMENTS[0], "h100"),
  *[pytest.param(*placement, "h100", marks=pytest.mark.long) for placement in PLACEMENTS[1:]],
]


@pytest.mark.parametrize("ffn_type, ici, placement, d_split, target", PLACEMENT_TARGETS)
def test_each_placement_compiles_with_bf16_on_the_wire(ffn_type, ici, placement, d_split, target):
  config = compile_config(ffn_type, **ici)
  if ffn_type != "moe":
    config.model.ffn.placement = placement
  if d_split:  # two channels over expert=4: the tables split by d_model (logical_rules.D_MODEL_SPLIT_RULES)
    config.model.ffn.n_channels = 2
    config.model.d_model = 512  # 128 columns a device: a Mosaic GPU chunk spans 128 threads
    config.mesh.rules = logical_rules.D_MODEL_SPLIT_RULES + tuple(tuple(r) for r in config.mesh.rules)
  mosaic_rows = target == "h100" and ffn_type != "moe"  # every placement's row kernels also compile in Mosaic GPU
  if mosaic_rows:
    config.model.ffn.kernel.implementation = "mosaic"
  step = compiled(config, target)
  text = step.text
  assert_sparse_kernels(kernels(text), ffn_type, target, mosaic_rows)
  assert roofline.project(step.report, hardware.CHIPS["h100"]).step_overlap_s > 0  # every collective priced
  assert_loops_bounded(text)
  moved = [c for c in hlo_text.collectives(text) if c.op in ("all-gather", "all-to-all", "ragged-all-to-all")]
  # The feed-forward layers' rows of d_model values on the wire (tokens, MoE's pairs, dy) travel as bf16.
  ours = [c for c in moved if "/mlp/" in c.source or c.op == "ragged-all-to-all"]
  token_rows = [
    c.shape.lstrip("(") for c in ours if re.fullmatch(r"(bf16|f16|f32)\[[\d,]*,\d*(128|256|512)\]", c.shape.lstrip("("))
  ]
  assert all(shape.startswith("bf16") for shape in token_rows), token_rows
  assert token_rows or placement == "fsdp", [c.shape for c in moved]  # fsdp moves the tables, not the tokens
  if ffn_type == "moe":
    ragged = [c for c in hlo_text.collectives(text) if c.op == "ragged-all-to-all"]
    # Per layer: the rows out and back, forward and backward; a send buffer holds the device's n * k pairs of
    # bf16 rows (k * D * 2 bytes a token), of which (E - 1) / E leave the device on average; a receive buffer the
    # expert group's G * n * k.
    n, k = 8 * 128 // 4, config.model.ffn.experts_per_token
    assert len(ragged) == 4 * config.model.n_layers, ragged
    first = [re.match(r"\(*(\w+)\[(\d+),", c.shape).groups() for c in ragged]  # the payload: [rows, ...]
    assert {(dtype, int(rows)) for dtype, rows in first} == {("bf16", n * k), ("bf16", 4 * n * k)}, ragged


@pytest.mark.parametrize(
  "ffn_type, target",
  [
    *[(ffn_type, "v5p") for ffn_type in ("mlp", "sgatlin", "moe")],
    ("mlp", "h100"),
    pytest.param("sgatlin", "h100", marks=pytest.mark.long),  # make test-long: the sparse types for the H100 too
    pytest.param("moe", "h100", marks=pytest.mark.long),
  ],
)
def test_micro_batches_compile_with_the_gradient_reduced_after_the_loop(ffn_type, target):
  """train.microbatches=2: the per-device loop (parallel/microbatches.py) runs 2 trips with the fused attention and the row
  kernels inside it, and no gradient is reduced inside it."""
  config = compile_config(ffn_type)
  config.train.microbatches = 2
  step = compiled(config, target)
  text, built = step.text, step.built
  found = kernels(text)
  assert_sparse_kernels(found, ffn_type, target)
  assert_row_kernels_in_their_parts(step.text, found)
  assert expected_attention(target) <= set(found), found
  assert_loops_bounded(text)
  assert 2 in [loop.trips for loop in hlo_text.compiled_loops(text)]
  assert_analytic_memory_near_the_compilers(step)
  per_step, inside = reduced_elements(text)
  assert inside == 0, inside
  n_params, extra = reduction_budget(built)
  assert n_params <= per_step <= n_params + extra, (per_step, n_params, extra)


@pytest.mark.long  # a system case of half a minute or more: make test-long
@pytest.mark.slow
def test_a_ladder_rung_compiles_for_hopper_with_mosaic_gpu_row_kernels():
  """configs/ladder.py:sgatlin,2 (d_model 256, 16 x 8 slots, GPT-2's vocabulary, 2,048 tokens a row) with
  kernel.implementation=mosaic on 4 H100s: every row kernel compiles through ptxas for sm_90a at the tiling it picks
  for the device (kernels/rows/mosaic_tiling.py), one sequence a device."""
  config = load_config("configs/ladder.py", "sgatlin,2")
  config.model.ffn.kernel.update(implementation="mosaic")
  config.data.update(global_batch_size=4, eval_batch_size=4)
  config.mesh.ici.update(data=4, fsdp=1, tensor=1, expert=1)
  step = compiled(config, "h100")
  layers = config.model.n_layers
  assert_sparse_kernels(kernels(step.text), "sgatlin", "h100", mosaic_rows=True)
  assert kernels(step.text)["mosaic_gpu"] >= 6 * layers, kernels(step.text)  # 2 forward, 2 backward, 2 gradients


def test_row_order_dots_compile_for_the_h200_in_place_of_row_dots():
  """kernel.implementation=triton_row_order (rows/table.py's one line, a record with row_order=True): sgatlin's step compiled
  for one H200 takes its per-pair dots by row, forward and backward, two per layer, and no token-order row_dots;
  each launch sits in its part."""
  config = compile_config("sgatlin", data=1)
  config.model.ffn.kernel.update(implementation="triton_row_order")
  program, _, _ = aot.compile_for_topology(config_lib.validate(config), "h200:1x1x1")
  found = kernels(program.as_text())
  assert found.get("row_order_dots") == 2 * config.model.n_layers and "row_dots" not in found, found
  assert {"row_accumulate", "segment_sums"} <= set(found), found
  assert_row_kernels_in_their_parts(program.as_text(), found)


def test_the_fused_forward_compiles_for_the_h200_in_place_of_the_forwards_row_kernels():
  """kernel.implementation=triton_fused (rows/table.py's one line, a record with fused=True): sgatlin's step compiled for
  one H200 takes each layer's forward as one Triton kernel; the backward keeps its row_dots and row_accumulate."""
  config = compile_config("sgatlin", data=1)
  config.model.ffn.kernel.update(implementation="triton_fused")
  program, _, _ = aot.compile_for_topology(config_lib.validate(config), "h200:1x1x1")
  found = kernels(program.as_text())
  layers = config.model.n_layers
  assert found.get("fused_forward") == layers and found.get("row_dots") == layers, found
  assert found.get("row_accumulate") == layers and "segment_sums" in found, found
  assert_row_kernels_in_their_parts(program.as_text(), found)


# What each design launches for one gated gather, forward and gradients (segment_sums aside: its count follows the
# tables); an implementation not listed must launch Pallas kernels of its own.
DESIGN_LAUNCHES = {
  "triton": {"row_dots": 2, "row_accumulate": 2},
  "triton_row_order": {"row_order_dots": 2, "row_accumulate": 2},
  "triton_fused": {"fused_forward": 1, "row_dots": 1, "row_accumulate": 1},
  "tpu": {"row_dots": 2, "row_accumulate": 2},
  "tpu_row_order": {"row_order_dots": 2, "row_accumulate": 2},
  "tpu_fused": {"fused_forward": 1, "row_dots": 1, "row_accumulate": 1},
}
DEVICE_OF = {"gpu": "h100:1x1x4", "tpu": "v5p:2x2x1"}


@pytest.mark.parametrize("name", [i.name for i in registry.ROWS if i.platform is not None])
def test_every_registered_kernel_implementation_compiles_for_its_device(name):
  """Each implementation in the registry (a new one without an edit here): the gated gather with it, forward and
  gradients (bf16, sgatlin's 128 slots, tanh-GELU inside the gate), compiled by its device's compiler for one H100
  (through ptxas for sm_90a) or one v5p core."""
  spec = jax.ShapeDtypeStruct
  implementation = registry.by_name("rows", name)
  options = registry.naming(implementation, KernelOptions())

  def loss(x, w_in, w_out, gates, rows):
    y = gated_gather(x, w_in, w_out, rows, gates, gelu_tanh, options=options, implementation=implementation)
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))  # the gradient needs y: the forward is kept

  table = spec((2048, 256), jnp.float32)
  args = (spec((1, 256, 256), jnp.bfloat16), table, table, spec((1, 256, 128), jnp.float32))
  args += (spec((1, 256, 128), jnp.int32),)
  with aot.on_topology(DEVICE_OF[implementation.platform]):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower().compile()
  found = {kernel: n for kernel, n in kernels(compiled.as_text()).items() if kernel != "segment_sums"}
  assert found == DESIGN_LAUNCHES.get(name, found) and found, found


@pytest.mark.parametrize(
  "design, launched",
  [("tpu_row_order", {"row_order_dots": 2, "row_accumulate": 2})],  # both dots passes by row, no token-order dots
)
@pytest.mark.long  # a system case of half a minute or more: make test-long
def test_a_measured_table_puts_a_tpu_design_into_the_v5p_step(tmp_path, monkeypatch, design, launched):
  """On a TPU `auto` takes what the device measured (kernels/autotune_table.py): a table that ranks a design first
  for this shape makes the step compiled for a v5p launch its kernels in place of the token-order ones; without the
  table the default order's Pallas TPU kernels run (test_sparse_kernels_compile)."""
  monkeypatch.setenv(autotune_table.ENV, str(tmp_path / "autotune.json"))
  config = compile_config("sgatlin")
  mesh = aot.topology_mesh(config_lib.validate(config), TOPOLOGIES["v5p"])
  kind = mesh.devices.flat[0].device_kind
  calls = step_kernels.step_calls(config_lib.validate(config), state_lib.setup(config_lib.validate(config), mesh=mesh))
  entry = autotune_table.Entry((design, "tpu", "xla"), {}, {design: 1.0, "tpu": 2.0, "xla": 3.0})
  for op, shape in calls:
    autotune_table.record(kind, op, shape, entry)
  program, _, _ = aot.compile_for_topology(config_lib.validate(config), TOPOLOGIES["v5p"])
  found = kernels(program.as_text())
  layers = config.model.n_layers
  row_work = {name: count for name, count in found.items() if name in {*ROW_KERNEL_PARTS} - {"segment_sums"}}
  assert row_work == {name: n * layers for name, n in launched.items()}, found


@pytest.mark.parametrize("target", ["v5p", "h100"])
def test_fused_attention_on_a_mesh_adds_no_collective(target):
  """Splash (TPU) and cuDNN (GPU) attention, forward and backward, on data=4 with the other mesh axes idle (size 1):
  each device runs on its own rows and heads (parallel/attention_placement.py), so the compiled program moves
  nothing. An idle axis left to the compiler in a manual region is what added no-op all-reduces elsewhere."""
  config = compile_config("mlp")
  mesh = aot.topology_mesh(config_lib.validate(config), TOPOLOGIES[target])
  implementation = "splash" if target == "v5p" else "cudnn"
  B, T, H, K = 8, 128, 2, 64
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh_lib.batch_axes(mesh, config.mesh.rules)))

  def forward_and_backward(q, k, v, segment_ids, dout):
    attend = lambda q, k, v: attention.fused_attention(implementation, q, k, v, segment_ids)  # noqa: E731
    out, vjp = jax.vjp(attend, q, k, v)
    return out, *vjp(dout)

  qkv = jax.ShapeDtypeStruct((B, T, H, K), jnp.bfloat16, sharding=rows)
  segment_ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=rows)
  with logical_rules.activate(mesh, config.mesh.rules):
    text = jax.jit(forward_and_backward).lower(qkv, qkv, qkv, segment_ids, qkv).compile().as_text()
  assert expected_attention(target) <= set(kernels(text)), kernels(text)
  assert hlo_text.collectives(text) == [], hlo_text.collectives(text)


HEAD_SPECS = r"(?:btd,(?:dv|vd)->btv|btv,(?:dv|vd)->btd|btd,btv->(?:dv|vd))"  # logits, dx, dW (untied or tied)


def head_dot_operand_dtypes(text) -> set:
  """The dtypes of the operands of every dot the LM head's einsum (tied or not) compiles to (a GPU gemm fusion's
  dot, a TPU convolution), read from the instructions defining them in the dot's computation."""
  found = set()
  for lines in hlo_text.computations(text).values():
    defined = {m[1]: m[2] for line in lines for m in [re.match(r"\s*(?:ROOT )?(%\S+) = (\w+)\[", line)] if m}
    for line in lines:
      head = re.search(r" (?:dot|convolution)\((%[^,]+), (%[^,)]+)\).*op_name=\"[^\"]*" + HEAD_SPECS, line)
      if head:
        found |= {defined[operand] for operand in head.groups() if operand in defined}
  return found


@pytest.mark.parametrize("target", ["h100", pytest.param("a100", marks=pytest.mark.long)])
def test_the_lm_head_reads_its_operands_in_the_configured_dtype(target):
  """config.model.logits_dot_in_fp32: the compiled head's dots on a GPU (the chunked loss's tiles: forward,
  recompute and both gradients) read float32 operands by default (TF32 at best: half the bf16 rate) and bf16 ones
  when False, logits float32 either way. (libtpu rounds a float32 dot's operands to bf16 at default precision by
  itself: the option changes little on a TPU.)"""
  dtypes = {}
  for fp32 in (True, False):
    config = compile_config("mlp")
    config.model.logits_dot_in_fp32 = fp32
    dtypes[fp32] = head_dot_operand_dtypes(compiled(config, target).text)
  assert dtypes[True] and "bf16" not in dtypes[True], dtypes
  assert dtypes[False] == {"bf16"}, dtypes


@pytest.mark.parametrize("target", ["h100", "v5p"])
def test_product_key_top_k_launches_no_more_kernels_for_a_larger_k(target):
  """The accelerators' stage two sorts the candidate pairs once (product_keys._neuron_ids_top_k): its compiled
  launches do not grow with k. The k passes of max it replaced took about 3 launches a pass on a GPU (9 at k=4,
  27 at k=8 on H100; 35 and 50 on v5p), each reading every candidate."""
  spec = jax.ShapeDtypeStruct((256, 16, 64), jnp.float32)
  launches = {}
  for k in (4, 8):
    with aot.on_topology(TOPOLOGIES[target]):
      program = jax.jit(lambda s1, s2: product_key_top_k(s1, s2, k)[1]).trace(spec, spec).lower().compile()
    launches[k] = sum(launch.runs for launch in hlo_text.launches(program.as_text()))
  assert launches[8] <= launches[4], launches


HOST_TRANSFERS = re.compile(r"\b(send|recv|send-done|recv-done|infeed|outfeed)\(|custom_call_target=\"[^\"]*[Hh]ost")


@pytest.mark.long  # four compiles of sgatlin, 75 s
@pytest.mark.parametrize("target", ["v5p", "h100"])
def test_skipping_bad_steps_adds_no_host_transfer_or_state_copy(target):
  """config.train.bad_steps=skip decides on the device and selects after the update (behind a barrier per leaf, so
  the update computes what `stop`'s does): against `stop`, the compiled step updates the same state in place
  (aliased bytes), copies no array more, transfers nothing to the host, and needs at most one leaf's new value more
  temporaries (the select reads it beside the old one), plus 1% and the record's few bytes."""
  programs = {}
  for mode in ("stop", "skip"):
    config = compile_config("sgatlin")
    config.train.bad_steps = mode
    program, built, _ = aot.compile_for_topology(config_lib.validate(config), TOPOLOGIES[target])
    programs[mode] = program.memory_analysis(), program.as_text()
  (stop, stop_text), (skip, skip_text) = programs["stop"], programs["skip"]
  assert skip.alias_size_in_bytes == stop.alias_size_in_bytes and skip.alias_size_in_bytes > 0
  assert skip.output_size_in_bytes == stop.output_size_in_bytes
  leaf = max(
    math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
    for a in jax.tree.leaves((built.abstract_state.params, built.abstract_state.opt_state))
  )
  assert skip.temp_size_in_bytes <= 1.01 * stop.temp_size_in_bytes + leaf + 4096, (skip, stop, leaf)
  copies = [len(re.findall(r"= \S+ copy\(", text)) for text in (stop_text, skip_text)]
  assert copies[1] <= copies[0], copies
  assert not HOST_TRANSFERS.search(skip_text)

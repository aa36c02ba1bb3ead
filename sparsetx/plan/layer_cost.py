"""The analytic cost of a feed-forward layer, and of the rest of the step, per train step on one device.

The dry run's roofline reads the CPU-compiled program, which counts a loop body once and shapes the sparse layers for
a CPU's caches; this model counts what the accelerator kernels move and compute from the config's shapes alone
(each type's FfnSpec.cost), phase by phase, and times each phase on a chip. docs/cost_model.md derives the bytes.
"""

import math

import jax.numpy as jnp

from sparsetx import config as config_lib
from sparsetx import hardware
from sparsetx.config.placements import EXPERT, Placement
from sparsetx.models.ffn.registry import SPECS
from sparsetx.parallel import logical_rules, per_device
from sparsetx.perf import roofline
from sparsetx.perf.cost import F32, CostBuilder, LayerCost, Phase, time_on


def layer_cost(
  model,
  ffn,
  tokens: int,
  expert_group: int = 1,
  d_group: int = 1,
  devices: int | None = None,
  placement: Placement = EXPERT,
  microbatches: int = 1,
):
  """The LayerCost of one feed-forward layer `ffn` of `model` per train step on one device.

  tokens: own tokens per device; expert_group: E, the devices the layer's units are split over (sgatlin channels,
  FFF trees, MoE experts); d_group: G, the devices its tables' d_model is split over (sgatlin / PEER: the d-split
  gather; others: FSDP); devices: the devices that train the model (data-parallel gradient sums; default E G),
  all of them holding other tokens. placement: the tables' (parallel/tables.py); under fsdp and data the kernels see the
  device's own tokens and whole tables (E = G = 1), fsdp gathering them from all `devices`. microbatches: the
  step's micro-batch count.
  """
  if ffn.type not in SPECS:
    raise config_lib.ConfigError(f"no feed-forward type {ffn.type!r}; use one of {', '.join(SPECS)}.")
  b = jnp.dtype(model.dtype).itemsize
  devices = devices or expert_group * d_group
  if placement.whole_on_device:
    expert_group, d_group = 1, 1
  bld = CostBuilder(config_lib.remat_policy(model), placement, microbatches, devices)
  SPECS[ffn.type].cost(bld, model, ffn, tokens, expert_group, d_group, b, devices)
  return bld.cost(ffn.type, tokens)


# From a config and a mesh -------------------------------------------------------------------------------------


def _axes_size(mesh_shape: dict, axes) -> int:
  return math.prod(mesh_shape.get(a, 1) for a in per_device.axis_tuple(axes))


def groups(config, ffn, mesh_shape: dict) -> tuple[int, int]:
  """(E, G) of `ffn` under config.mesh.rules: sizes of the mesh axes of its units and of its tables' d_model."""
  spec, rules = SPECS[ffn.type], config.mesh.rules
  if spec.units is None and spec.neuron_table is None:
    return 1, _axes_size(mesh_shape, config_lib.rule_axes(rules, "embed"))
  names = spec.neuron_table or spec.units.table_axes
  table = logical_rules.table_spec(names, rules)
  units = _axes_size(mesh_shape, table[names.index(spec.units.name)]) if spec.units is not None else 1
  return units, _axes_size(mesh_shape, table[names.index("embed")])


def batch_shards(config, mesh_shape: dict) -> int:
  """The devices holding other tokens: the size of the mesh axes of `batch`."""
  return _axes_size(mesh_shape, config_lib.rule_axes(config.mesh.rules, "batch"))


def tokens_per_device(config, mesh_shape: dict) -> int:
  """Own tokens per device: the global batch's tokens over the batch shards."""
  return config.data.global_batch_size * config.data.seq_len // batch_shards(config, mesh_shape)


def distinct_ffns(model) -> list[tuple[object, tuple, str]]:
  """(feed-forward sub-config, its layer indices, its config prefix) per distinct one (one unless mixed)."""
  by_ffn = {}
  for i in range(model.n_layers):
    ffn = config_lib.layer_ffn_config(model, i)
    prefix = "config.model.ffn" if ffn is model.ffn else "config.model.dense_ffn"
    by_ffn.setdefault(id(ffn), (ffn, [], prefix))[1].append(i)
  return [(ffn, tuple(layers), prefix) for ffn, layers, prefix in by_ffn.values()]


def remainder_cost(config, mesh_shape: dict) -> LayerCost:
  """The step without its feed-forward layers, analytically: attention blocks, embedding, head, their optimizer.

  Attention per block: q, k, v, out projections (matmuls), a fused attention kernel (reads q, k, v, writes o;
  4 T D FLOPs per token as the ladder counts them; its backward reads q, k, v, o, do, writes dq, dk, dv, 2.5x the
  FLOPs: recompute plus two gradient products), the head's [D, V] matmul with float32 logits (its operands as
  config.model.logits_dot_in_fp32 gives them; a float32 operand's slower GPU rate, TF32, is not modeled; the
  chunked loss's tiles computed twice) and the loss reading them, the embedding rows. Its collectives are left to
  the compiled program (roofline.project_analytic).
  """
  model = config.model
  n, T = tokens_per_device(config, mesh_shape), config.data.seq_len
  D, V, layers = model.d_model, model.vocab_size, model.n_layers
  b = jnp.dtype(model.dtype).itemsize
  bld = CostBuilder(config_lib.remat_policy(model))
  block = CostBuilder(bld.remat)
  block.matmul("attention q, k, v", n, D, 3 * D, b, b, b)
  block.matmul("attention out", n, D, D, b, b, b)
  block.add("attention kernel", 4 * n * D * b, 4 * n * T * D, forward=True)
  block.add("attention kernel backward", 8 * n * D * b, 2.5 * 4 * n * T * D)
  for p in block.phases:
    bld.phases.append(Phase(f"{layers} x {p.name}", layers * p.nbytes, layers * p.flops, p.runs))
  head_b = F32 if model.get("logits_dot_in_fp32", True) else b  # the head's operands (transformer.head_dot)
  bld.matmul("head", n, D, V, head_b, head_b, F32, forward_runs=False)
  if config_lib.loss_chunk_count(V, config.train.get("loss_chunks", 0)) > 1:  # train/loss.py: tiles rematerialized
    bld.add("head recomputed by the chunked loss", n * D * head_b + D * V * head_b + n * V * F32, 2 * n * D * V)
  bld.add("loss (logits read, dlogits written)", n * V * (F32 + b), 5 * n * V)
  bld.add("embedding rows and their gradient", n * D * (b + F32), 0)
  elements = 4 * D * D * layers + V * D * (1 if model.tie_embeddings else 2)
  bld.cast(elements, b)
  rules = config.mesh.rules
  shards = _axes_size(mesh_shape, config_lib.rule_axes(rules, "embed")) * _axes_size(
    mesh_shape, config_lib.rule_axes(rules, "heads")
  )
  bld.optimizer(elements / shards)
  return bld.cost("rest", n)


# Tables ---------------------------------------------------------------------------------------------------------


def _short(chip: hardware.Chip) -> str:
  return chip.name.replace(" SXM", "").replace("TPU ", "")


def format_layer(layers: tuple, cost: LayerCost, chips: list) -> str:
  """One layer's phases (bytes, FLOPs, time per chip), collectives, and the layer's time and HBM-bound share."""
  times = [time_on(cost, chip) for chip in chips]
  names = "".join(f"{_short(c) + ' us':>10}" for c in chips)
  span = f"layers {layers[0]}..{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
  lines = [
    f"{cost.name} feed-forward ({span}; per layer and device, {cost.tokens:,} tokens; sparsetx/plan/layer_cost.py)",
    f"  {'phase':<50}{'runs':>5}{'MB':>10}{'GFLOP':>10}{names}",
  ]
  for i, p in enumerate(cost.phases):
    cells = "".join(f"{t.phase_s[i] * 1e6:>9.3g}{'*' if t.hbm_bound[i] else ' '}" for t in times)
    lines.append(f"  {p.name:<50}{p.runs:>5}{p.nbytes / 1e6:>10.4g}{p.flops / 1e9:>10.4g}{cells}")
  for c in cost.collectives:
    cells = "".join(f"{roofline.collective_seconds(c.op, c.nbytes, c.group, t.chip) * 1e6:>9.3g} " for t in times)
    label = f"{c.op} /{c.group}: {c.what}"
    lines.append(f"  {label:<50}{c.runs:>5}{c.nbytes / 1e6:>10.4g}{'':>10}{cells}")
  lines.append(
    f"  {'total':<50}{'':>5}{cost.nbytes / 1e6:>10.4g}{cost.flops / 1e9:>10.4g}"
    + "".join(f"{t.total_s * 1e6:>9.3g} " for t in times)
  )
  lines.append(f"  {'HBM-bound share of the layer time':<75}" + "".join(f"{t.hbm_share:>9.0%} " for t in times))
  lines.append(
    "  (* = HBM-bound phase: bytes / bandwidth > FLOPs / peak; time = max of the two; collectives ring time)"
  )
  return "\n".join(lines)


PAPER_TOKENS_PER_DEVICE = 128 * 2048 // 8  # the paper's setup: 128 x 2,048 tokens per step on 8 devices
PAPER_EXPERT_GROUP = 8


def ladder_rows(scales=(2, 5, 8), ffn_types=("sgatlin", "fff", "moe", "mlp"), tokens=PAPER_TOKENS_PER_DEVICE):
  """(type, scale, E, LayerCost, [LayerTime per chip]) per rung: the expert group is the largest divisor of
  PAPER_EXPERT_GROUP that divides the type's units (FFF's ladder has 4, 12, 20 trees: E = 4), 1 for dense types."""
  from sparsetx.models import ladder

  rows = []
  for ffn_type in ffn_types:
    for scale in scales:
      model = ladder.ladder_model_config(scale, ffn_type)
      spec = SPECS[ffn_type]
      E = math.gcd(model.ffn[spec.units.field], PAPER_EXPERT_GROUP) if spec.units is not None else 1
      cost = layer_cost(model, model.ffn, tokens, E, 1, devices=PAPER_EXPERT_GROUP)
      rows.append((ffn_type, scale, E, cost, [time_on(cost, chip) for chip in hardware.chips("all")]))
  return rows


def format_ladder(rows) -> str:
  """A markdown table of ladder_rows: per-layer time (us), its HBM-bound and collective shares on each chip."""
  chips = hardware.chips("all")
  head = " | ".join(f"{_short(c)} us (HBM, comm)" for c in chips)
  lines = [
    f"| type | scale | E | tables MB | GB moved | GFLOP | {head} |",
    "|---|---:|---:|---:|---:|---:|" + "---:|" * len(chips),
  ]
  for ffn_type, scale, E, cost, times in rows:
    cells = " | ".join(f"{t.total_s * 1e6:,.0f} ({t.hbm_share:.0%}, {t.comm_s / t.total_s:.0%})" for t in times)
    lines.append(
      f"| {ffn_type} | {scale} | {E} | {cost.table_bytes / 1e6:,.1f} | {cost.nbytes / 1e9:.2f} | {cost.flops / 1e9:,.0f}"
      f" | {cells} |"
    )
  return "\n".join(lines)

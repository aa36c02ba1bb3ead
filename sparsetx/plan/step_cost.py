"""A config's step on a mesh, analytically: where each sparse layer's tables go (parallel/sparse_forms.py runs it) and
the step's cost and projected time with every layer so placed, from layer_cost.py's per-layer model.

Placement: the bytes each placement sends per device and step, whether it can run, the choice under "auto"
(docs/expert_parallel.md, "Table placement", says why), and the dry run's tables.
"""

import dataclasses
import math

import jax.numpy as jnp

from sparsetx import config as config_lib
from sparsetx.models.ffn.registry import SPECS
from sparsetx.parallel import tables
from sparsetx.perf import hardware, roofline
from sparsetx.plan.layer_cost import (
  F32,
  LayerCost,
  distinct_ffns,
  format_layer,
  groups,
  layer_cost,
  remainder_cost,
  tokens_per_device,
)


def placeable(ffn) -> bool:
  """Whether the layer type has tables a placement moves (the sparse types)."""
  return SPECS[ffn.type].sparse


def batch_axes(config, mesh_shape: dict) -> tuple:
  """The mesh axes (size > 1) the batch is split over: the devices that hold other tokens."""
  axes = config_lib.rule_axes(config.mesh.rules, "batch")
  return tuple(a for a in axes if mesh_shape.get(a, 1) > 1)


def placed_cost(config, ffn, mesh_shape: dict, placement: str) -> LayerCost:
  """The LayerCost of `ffn` with its tables placed as given, at the config's tokens per device and micro-batches."""
  shards = math.prod(mesh_shape[a] for a in batch_axes(config, mesh_shape))
  return layer_cost(
    config.model,
    ffn,
    tokens_per_device(config, mesh_shape),
    *groups(config, ffn, mesh_shape),
    devices=shards,
    placement=placement,
    microbatches=config.train.microbatches,
  )


def placement_bytes(cost: LayerCost) -> float:
  """Bytes one device sends per step because of where the layer's tables are: the tokens' moves (expert), the
  tables' gathers and gradient reduce-scatters (fsdp), the table gradients' all-reduce (all; data's only one)."""
  return sum(c.sent for c in cost.collectives if c.placed)


def table_mib(config, ffn) -> float:
  """MiB of one layer's parameters as stored (its tables and router; config.model.param_dtype): what the data
  placement replicates, at most."""
  spec = SPECS[ffn.type]
  total = spec.params(config.model, ffn)[0]
  return total * jnp.dtype(config.model.param_dtype).itemsize / 2**20


# config.mesh.max_replicated_mib is 1/512 of the chip's HBM (plan/targets.py sets it so), so it stands for HBM.
HBM_PER_REPLICATED_LIMIT = 512


def held_tables_gib(config, ffn) -> float:
  """GiB one device holds during a step with micro-batches when `ffn`'s tables enter the per-device loop whole
  (fsdp, data): every layer of that type's parameters (`table_mib`) as stored and two float32 gradient sums
  (parallel/microbatches.py)."""
  n_layers = sum(len(layers) for f, layers, _ in distinct_ffns(config.model) if f is ffn) or config.model.n_layers
  itemsize = jnp.dtype(config.model.param_dtype).itemsize
  return n_layers * table_mib(config, ffn) * (itemsize + 2 * F32) / itemsize / 1024


@dataclasses.dataclass(frozen=True)
class PlacementOption:
  placement: str
  nbytes: float  # bytes one device sends per step for this layer with its tables so placed (placement_bytes)
  refused: str = ""  # why the layer cannot run so on this mesh and config ("" when it can)


def placement_options(config, ffn, mesh_shape: dict) -> dict:
  """{placement: PlacementOption} for `ffn` on a mesh of mesh_shape, at the config's tokens per device.

  expert needs the units (and a neuron table's d_model) to split over their axes (models/ffn/placement.py); fsdp
  d_model to split over the batch shards, and with micro-batches (whose per-device loop holds the tables whole,
  with their float32 gradient sums) those of all its layers within half the HBM the replication limit stands
  for (`held_tables_gib`); data a table within config.mesh.max_replicated_mib (the replication check refuses it
  otherwise). The bytes are given either way: what the placement would move."""
  shards = math.prod(mesh_shape[a] for a in batch_axes(config, mesh_shape))
  held, budget = held_tables_gib(config, ffn), config.mesh.max_replicated_mib * HBM_PER_REPLICATED_LIMIT / 2 / 1024
  spec, (E, G) = SPECS[ffn.type], groups(config, ffn, mesh_shape)
  options = {}
  for placement in tables.PLACEMENTS:
    refused = ""
    if placement == "expert" and spec.units is not None and ffn[spec.units.field] % E:
      refused = f"{spec.units.field}={ffn[spec.units.field]} does not split over {E} devices"
    elif placement == "expert" and config.model.d_model % G:
      refused = f"d_model={config.model.d_model} does not split over {G} devices"
    elif placement == "fsdp" and config.model.d_model % shards:
      refused = f"d_model={config.model.d_model} does not split over the {shards} batch shards"
    elif placement == "fsdp" and shards > 1 and config.train.microbatches > 1 and held > budget:
      refused = (
        f"the micro-batch loop would hold {held:.1f} GiB of whole tables and gradient sums, over half the HBM "
        f"config.mesh.max_replicated_mib={config.mesh.max_replicated_mib:.0f} stands for ({budget:.1f} GiB)"
      )
    elif placement == "data" and shards > 1 and table_mib(config, ffn) > config.mesh.max_replicated_mib:
      refused = (
        f"{table_mib(config, ffn):.0f} MiB replicated, over config.mesh.max_replicated_mib="
        f"{config.mesh.max_replicated_mib:.0f}"
      )
    nbytes = placement_bytes(placed_cost(config, ffn, mesh_shape, placement))
    options[placement] = PlacementOption(placement, nbytes, refused)
  return options


def choose_placement(config, ffn, mesh_shape: dict) -> tuple[str, dict]:
  """(the placement `ffn` runs, placement_options or None): its config value, or under "auto" the runnable one that
  sends the fewest bytes per device and step (ties: expert, then fsdp, then data, the order of tables.PLACEMENTS;
  expert when none can run, whose error then names the field)."""
  wanted = ffn.get("placement", "auto")
  if wanted != "auto":  # no cost model to run
    return wanted, None
  options = placement_options(config, ffn, mesh_shape)
  runnable = [p for p in tables.PLACEMENTS if not options[p].refused]
  return (min(runnable, key=lambda p: options[p].nbytes) if runnable else "expert"), options


def resolve_placements(config, mesh_shape: dict):
  """config with each sparse feed-forward sub-config's placement "auto" replaced by `choose_placement`'s (a copy;
  config itself when nothing is "auto"), for the model the trainer builds on this mesh."""
  auto = [
    prefix
    for ffn, _, prefix in distinct_ffns(config.model)
    if placeable(ffn) and ffn.get("placement", "auto") == "auto"
  ]
  if not auto:
    return config
  resolved = config.copy_and_resolve_references()
  for ffn, _, prefix in distinct_ffns(resolved.model):
    if prefix in auto:
      with ffn.unlocked():
        ffn.placement = choose_placement(resolved, ffn, mesh_shape)[0]
  return resolved


def format_placements(config, mesh_shape: dict) -> str:
  """The dry run's placement table: per sparse layer, the bytes each placement sends per device and step, and the
  one chosen."""
  lines = []
  for ffn, layers, prefix in distinct_ffns(config.model):
    if not placeable(ffn):
      continue
    chosen = choose_placement(config, ffn, mesh_shape)[0]
    options = placement_options(config, ffn, mesh_shape)
    span = f"layers {layers[0]}..{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
    how = "auto: fewest bytes" if ffn.get("placement", "auto") == "auto" else f"{prefix}.placement"
    lines.append(
      f"{ffn.type} table placement ({span}; bytes each device sends per step and layer, "
      f"{tokens_per_device(config, mesh_shape):,} tokens, {config.train.microbatches} micro-batches; "
      "docs/expert_parallel.md):"
    )
    for placement in tables.PLACEMENTS:
      option = options[placement]
      mark = f"  <- chosen ({how})" if placement == chosen else ""
      refused = f"  (cannot run: {option.refused})" if option.refused else ""
      lines.append(f"  {placement:<8}{option.nbytes / 1e6:>12,.1f} MB{mark}{refused}")
  return "\n".join(lines)


# The step with every layer placed ---------------------------------------------------------------------------


def config_layer_costs(config, mesh_shape: dict) -> list[tuple[tuple, LayerCost]]:
  """(layer indices, LayerCost) per distinct feed-forward config of the model (one entry unless it is mixed), each
  sparse layer at its placement (config.model.ffn.placement, "auto" resolved by `choose_placement`)."""
  out = []
  for ffn, layers, _ in distinct_ffns(config.model):
    placement = choose_placement(config, ffn, mesh_shape)[0] if placeable(ffn) else "expert"
    out.append((layers, placed_cost(config, ffn, mesh_shape, placement)))
  return out


def step_parts(config, mesh_shape: dict) -> list[tuple[int, LayerCost]]:
  """(layers, LayerCost) for each distinct feed-forward layer and (1, remainder_cost): roofline.project_analytic's
  parts."""
  parts = [(len(layers), cost) for layers, cost in config_layer_costs(config, mesh_shape)]
  return parts + [(1, remainder_cost(config, mesh_shape))]


def project_step(config, mesh_shape: dict, chip: hardware.Chip, rest_collectives=()) -> roofline.Projection:
  """The dry run's analytic projection of `config`'s train step on a mesh of `mesh_shape` `chip`s (roofline.
  project_analytic over step_parts): tokens/s, step time and MFU without compiling. `rest_collectives`: the
  compiled program's collectives outside the feed-forward layers; without them (none given) the step is faster
  by their time, so what it consumes is an upper bound."""
  from sparsetx.models import ladder

  tokens = config.data.global_batch_size * config.data.seq_len
  model_flops = 3.0 * ladder.forward_flops_per_token(config.model, config.data.seq_len)["total"] * tokens
  devices = math.prod(mesh_shape.values())
  return roofline.project_analytic(chip, step_parts(config, mesh_shape), tokens, model_flops, devices, rest_collectives)


def format_config_layers(config, mesh_shape: dict, chips: list | None = None) -> str:
  """The dry run's per-layer table for every distinct feed-forward layer of `config` on a mesh of `mesh_shape`."""
  chips = chips or hardware.chips("all")
  return "\n".join(format_layer(layers, cost, chips) for layers, cost in config_layer_costs(config, mesh_shape))


# docs/kernels.md's ladder table -----------------------------------------------------------------------------------

"""A config's step on a mesh, analytically: where each sparse layer's tables go (parallel/sparse_forms.py runs it) and
the step's cost and projected time with every layer so placed, from layer_cost.py's per-layer model.

Placement: the bytes each placement sends per device and step, whether it can run, the choice under "auto"
(docs/expert_parallel.md, "Table placement", says why), and the dry run's tables.
"""

import dataclasses
import math

from sparsetx import hardware
from sparsetx.config.placements import EXPERT, PLACEMENTS, Placement
from sparsetx.models.ffn.registry import SPECS
from sparsetx.perf import roofline
from sparsetx.plan import placement_plans
from sparsetx.plan.layer_cost import (
  LayerCost,
  batch_shards,
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


def placed_cost(config, ffn, mesh_shape: dict, placement: Placement) -> LayerCost:
  """The LayerCost of `ffn` with its tables placed as given, at the config's tokens per device and micro-batches."""
  return layer_cost(
    config.model,
    ffn,
    tokens_per_device(config, mesh_shape),
    *groups(config, ffn, mesh_shape),
    devices=batch_shards(config, mesh_shape),
    placement=placement,
    microbatches=config.train.microbatches,
  )


def placement_bytes(cost: LayerCost) -> float:
  """Bytes one device sends per step because of where the layer's tables are: the tokens' moves (expert), the
  tables' gathers and gradient reduce-scatters (fsdp), the table gradients' all-reduce (all; data's only one)."""
  return sum(c.sent for c in cost.collectives if c.placed)


@dataclasses.dataclass(frozen=True)
class PlacementOption:
  placement: str
  nbytes: float  # bytes one device sends per step for this layer with its tables so placed (placement_bytes)
  refused: str = ""  # why the layer cannot run so on this mesh and config ("" when it can)


def placement_options(config, ffn, mesh_shape: dict) -> dict:
  """{placement name: PlacementOption} for `ffn` on a mesh of mesh_shape, at the config's tokens per device: the
  bytes each placement would move, and its refusal (plan/placement_plans.py) where it cannot run."""
  return {
    name: PlacementOption(
      name,
      placement_bytes(placed_cost(config, ffn, mesh_shape, placement)),
      placement_plans.refusal(placement, config, ffn, mesh_shape),
    )
    for name, placement in PLACEMENTS.items()
  }


def choose_placement(config, ffn, mesh_shape: dict) -> tuple[str, dict]:
  """(the placement `ffn` runs, placement_options or None): its config value, or under "auto" the runnable one that
  sends the fewest bytes per device and step (ties: the order of config.placements.PLACEMENTS; expert when none
  can run, whose error then names the field)."""
  wanted = ffn.get("placement", "auto")
  if wanted != "auto":  # no cost model to run
    return wanted, None
  options = placement_options(config, ffn, mesh_shape)
  runnable = [p for p in PLACEMENTS if not options[p].refused]
  return (min(runnable, key=lambda p: options[p].nbytes) if runnable else EXPERT.name), options


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
    for name, option in options.items():
      mark = f"  <- chosen ({how})" if name == chosen else ""
      refused = f"  (cannot run: {option.refused})" if option.refused else ""
      lines.append(f"  {name:<8}{option.nbytes / 1e6:>12,.1f} MB{mark}{refused}")
  return "\n".join(lines)


# The step with every layer placed ---------------------------------------------------------------------------


def config_layer_costs(config, mesh_shape: dict) -> list[tuple[tuple, LayerCost]]:
  """(layer indices, LayerCost) per distinct feed-forward config of the model (one entry unless it is mixed), each
  sparse layer at its placement (config.model.ffn.placement, "auto" resolved by `choose_placement`)."""
  out = []
  for ffn, layers, _ in distinct_ffns(config.model):
    placement = PLACEMENTS[choose_placement(config, ffn, mesh_shape)[0]] if placeable(ffn) else EXPERT
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

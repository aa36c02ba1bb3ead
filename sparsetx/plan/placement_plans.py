"""Each table placement's plan hook: when it cannot run a layer on a mesh, in one phrase (what "auto" skips, what the
dry run prints). A new placement's record (config/placements.py) gets its refusal here; what it moves is costed from
the record (perf/cost.CostBuilder.tables)."""

import dataclasses

import jax.numpy as jnp

from sparsetx.config.placements import DATA, EXPERT, FSDP, Placement
from sparsetx.models.ffn.registry import SPECS
from sparsetx.plan.layer_cost import F32, batch_shards, distinct_ffns, groups

# config.mesh.max_replicated_mib is 1/512 of the chip's HBM (plan/targets.py sets it so), so it stands for HBM.
HBM_PER_REPLICATED_LIMIT = 512


def table_mib(config, ffn) -> float:
  """MiB of one layer's parameters as stored (its tables and router; config.model.param_dtype): what the data
  placement replicates, at most."""
  total = SPECS[ffn.type].params(config.model, ffn)[0]
  return total * jnp.dtype(config.model.param_dtype).itemsize / 2**20


def held_tables_gib(config, ffn) -> float:
  """GiB one device holds during a step with micro-batches when `ffn`'s tables enter the per-device loop whole
  (fsdp, data): every layer of that type's parameters (`table_mib`) as stored and two float32 gradient sums
  (parallel/microbatches.py)."""
  n_layers = sum(len(layers) for f, layers, _ in distinct_ffns(config.model) if f is ffn) or config.model.n_layers
  itemsize = jnp.dtype(config.model.param_dtype).itemsize
  return n_layers * table_mib(config, ffn) * (itemsize + 2 * F32) / itemsize / 1024


@dataclasses.dataclass(frozen=True)
class LayerOnMesh:
  """What a refusal reads: a feed-forward sub-config of `config` on a mesh of `mesh_shape`."""

  config: object
  ffn: object
  mesh_shape: dict

  @property
  def shards(self) -> int:
    return batch_shards(self.config, self.mesh_shape)


def _expert_refusal(layer: LayerOnMesh) -> str:
  """The units (and a neuron table's d_model) split over their axes (models/ffn/placement.py checks the same)."""
  spec, d_model = SPECS[layer.ffn.type], layer.config.model.d_model
  E, G = groups(layer.config, layer.ffn, layer.mesh_shape)
  if spec.units is not None and layer.ffn[spec.units.field] % E:
    return f"{spec.units.field}={layer.ffn[spec.units.field]} does not split over {E} devices"
  if d_model % G:
    return f"d_model={d_model} does not split over {G} devices"
  return ""


def _fsdp_refusal(layer: LayerOnMesh) -> str:
  """d_model splits over the batch shards, and with micro-batches (whose per-device loop holds the tables whole, with
  their float32 gradient sums) those of all its layers fit half the HBM the replication limit stands for."""
  config, shards = layer.config, layer.shards
  if config.model.d_model % shards:
    return f"d_model={config.model.d_model} does not split over the {shards} batch shards"
  held, limit = held_tables_gib(config, layer.ffn), config.mesh.max_replicated_mib
  budget = limit * HBM_PER_REPLICATED_LIMIT / 2 / 1024
  if shards > 1 and config.train.microbatches > 1 and held > budget:
    return (
      f"the micro-batch loop would hold {held:.1f} GiB of whole tables and gradient sums, over half the HBM "
      f"config.mesh.max_replicated_mib={limit:.0f} stands for ({budget:.1f} GiB)"
    )
  return ""


def _data_refusal(layer: LayerOnMesh) -> str:
  """A replicated table within config.mesh.max_replicated_mib (the replication check refuses it otherwise)."""
  mib, limit = table_mib(layer.config, layer.ffn), layer.config.mesh.max_replicated_mib
  if layer.shards > 1 and mib > limit:
    return f"{mib:.0f} MiB replicated, over config.mesh.max_replicated_mib={limit:.0f}"
  return ""


REFUSALS = {EXPERT: _expert_refusal, FSDP: _fsdp_refusal, DATA: _data_refusal}


def refusal(placement: Placement, config, ffn, mesh_shape: dict) -> str:
  """Why `ffn`'s tables cannot be placed so on a mesh of mesh_shape ("" when they can)."""
  return REFUSALS[placement](LayerOnMesh(config, ffn, mesh_shape))

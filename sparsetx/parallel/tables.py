"""Where a sparse layer's tables live: the placements, the logical names a table is stored under, and the
tables a model declares (their partitioning boxes, which tracing its init returns)."""

import dataclasses

import flax.linen as nn
import jax
from flax import struct
from flax.core import meta

from sparsetx.config import TABLE_PLACEMENTS
from sparsetx.parallel import expert_parallel as ep

# The logical name of a table's d_model dimension under the fsdp placement: the rules' `batch` axes, so the table is
# split over every device that holds other tokens (ZeRO-3's layout) and gathered from all of them.
FSDP_TABLE_AXIS = "batch"
PLACEMENTS = tuple(p for p in TABLE_PLACEMENTS if p != "auto")  # what a layer runs: "auto" is resolved before


def placement_of(ffn) -> str:
  """The placement a layer with feed-forward sub-config `ffn` runs. "auto" is resolved for a mesh by
  plan/step_cost.resolve_placements (the trainer's setup does); unresolved (a model built without a mesh in
  view: evaluation, export) it runs "expert", the layout the rules give."""
  placement = ffn.get("placement", "auto")
  return "expert" if placement == "auto" else placement


def placed_names(names: tuple, placement: str) -> tuple:
  """The logical axis names a table is stored with under `placement`: as the layer gives them (expert), its
  d_model (`embed`) dimension on the batch axes and nothing else split (fsdp), or nothing split (data)."""
  if placement == "data":
    return (None,) * len(names)
  if placement == "fsdp":
    return tuple(FSDP_TABLE_AXIS if name == "embed" else None for name in names)
  return tuple(names)


@dataclasses.dataclass(frozen=True)
class NeuronTable:
  """A layer's neuron table as stored: its logical axes, which of them holds its units, and their count."""

  axes: tuple  # logical axis names of the parameter as the layer gives them, e.g. (None, "channel", "neuron", "embed")
  unit_axis: str | None  # the units' logical name ("channel"); None for a table shared by every channel (PEER)
  n_units: int
  placement: str = "expert"  # one of PLACEMENTS

  @property
  def stored_axes(self) -> tuple:
    """The logical names the parameter is declared with (its placement's)."""
    return placed_names(self.axes, self.placement)

  def layout(self, n_tokens: int):
    """The expert group this table's layout gives n_tokens tokens, or None for the plain computation (also for
    the fsdp and data placements, whose tables are whole where the kernels run)."""
    if self.placement != "expert":
      return None
    return ep.table_group(self.axes, self.unit_axis, self.n_units, n_tokens)


class TableBox(nn.LogicallyPartitioned):
  """A table parameter's flax partitioning box: its logical names, and `local`, the dimensions the expert
  placement's dispatcher takes as this device's block."""

  local: tuple = struct.field(default=(), pytree_node=False)


def table_param(module, name: str, init, shape, dtype, axes: tuple, local: tuple, placement: str = "expert"):
  """module.param(name, ...) for a table the dispatcher runs on: `shape` as stored, logical `axes` as the layer
  gives them (stored as `placement` places them, `placed_names`); `local` names the dimensions the expert
  placement's dispatcher takes as this device's block (units; a neuron table's d_model). Inside the step's
  per-device microbatch loop (parallel/microbatches.py), whose batch axes are manual, the table enters as that block
  (`ep.block_shape`) and the dispatcher's body runs on it without opening a shard_map over those axes; the fsdp
  and data placements' tables enter whole (gathered once, before the loop). The parameter is boxed as a
  `TableBox`, so `declared_tables` finds it in the model's traced init."""
  axes, local = placed_names(axes, placement), (tuple(local) if placement == "expert" else ())
  block = ep.block_shape(shape, axes, local, jax.sharding.get_abstract_mesh(), ep.active_rules())
  return module.param(name, lambda *args: TableBox(init(*args), tuple(axes), local=tuple(local)), block, dtype)


def declared_tables(boxed_params) -> dict:
  """{parameter path (tuple of names): (logical axes, dimensions taken as blocks)} of every table in a model's
  boxed parameters (its init, traced: `jax.eval_shape`), which the train step's per-device loop takes as blocks."""
  leaves = jax.tree_util.tree_leaves_with_path(boxed_params, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))
  return {
    tuple(getattr(k, "key", k) for k in path): (tuple(box.names), box.local)
    for path, box in leaves
    if isinstance(box, TableBox)
  }

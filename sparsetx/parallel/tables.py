"""A sparse layer's tables as stored: the logical names its placement (config/placements.py) gives them, and the
tables a model declares (their partitioning boxes, which tracing its init returns)."""

import dataclasses

import flax.linen as nn
import jax
from flax import struct
from flax.core import meta

from sparsetx.config.placements import EXPERT, Placement
from sparsetx.parallel import expert_groups, logical_rules


@dataclasses.dataclass(frozen=True)
class NeuronTable:
  """A layer's neuron table as stored: its logical axes, which of them holds its units, and their count."""

  axes: tuple  # logical axis names of the parameter as the layer gives them, e.g. (None, "channel", "neuron", "embed")
  unit_axis: str | None  # the units' logical name ("channel"); None for a table shared by every channel (PEER)
  n_units: int
  placement: Placement = EXPERT

  @property
  def stored_axes(self) -> tuple:
    """The logical names the parameter is declared with (its placement's)."""
    return self.placement.stored_names(self.axes)

  def layout(self, n_tokens: int):
    """The expert group this table's layout gives n_tokens tokens, or None for the plain computation (also for
    a placement whose tables are whole where the kernels run)."""
    if self.placement.whole_on_device:
      return None
    return expert_groups.table_group(self.axes, self.unit_axis, self.n_units, n_tokens)


class TableBox(nn.LogicallyPartitioned):
  """A table parameter's flax partitioning box: its logical names, and `local`, the dimensions the expert
  placement's dispatcher takes as this device's block."""

  local: tuple = struct.field(default=(), pytree_node=False)


def table_param(module, name: str, init, shape, dtype, axes: tuple, local: tuple, placement: Placement = EXPERT):
  """module.param(name, ...) for a table the dispatcher runs on: `shape` as stored, logical `axes` as the layer
  gives them (stored as `placement` names them); `local` names the dimensions the expert
  placement's dispatcher takes as this device's block (units; a neuron table's d_model). Inside the step's
  per-device microbatch loop (parallel/microbatches.py), whose batch axes are manual, the table enters as that block
  (`logical_rules.block_shape`) and the dispatcher's body runs on it without opening a shard_map over those axes; the tables of
  a placement that keeps them whole on a device enter whole (gathered once, before the loop). The parameter is boxed as a
  `TableBox`, so `declared_tables` finds it in the model's traced init."""
  axes, local = placement.stored_names(axes), placement.block_dims(local)
  block = logical_rules.block_shape(shape, axes, local, jax.sharding.get_abstract_mesh(), logical_rules.active_rules())
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

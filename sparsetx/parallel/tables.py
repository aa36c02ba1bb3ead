"""Where a sparse layer's tables live: the placements, the logical names a table is stored under, and the
record of the tables a model declares (traced from its init)."""

import contextlib
import contextvars
import dataclasses

import flax.linen as nn
import jax

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


_TABLES = contextvars.ContextVar("sparsetx_tables", default=None)  # {param path: (axes, local)} while recording


def table_param(module, name: str, init, shape, dtype, axes: tuple, local: tuple, placement: str = "expert"):
  """module.param(name, ...) for a table the dispatcher runs on: `shape` as stored, logical `axes` as the layer
  gives them (stored as `placement` places them, `placed_names`); `local` names the dimensions the expert
  placement's dispatcher takes as this device's block (units; a neuron table's d_model). Inside the step's
  per-device microbatch loop (parallel/microbatches.py), whose batch axes are manual, the table enters as that block
  (`ep.block_shape`) and the dispatcher's body runs on it without opening a shard_map over those axes; the fsdp
  and data placements' tables enter whole (gathered once, before the loop). `recording_tables` collects, by
  parameter path, the tables declared this way."""
  axes, local = placed_names(axes, placement), (tuple(local) if placement == "expert" else ())
  recorded = _TABLES.get()
  if recorded is not None:
    recorded[tuple(module.scope.path) + (name,)] = (tuple(axes), tuple(local))
  block = ep.block_shape(shape, axes, local, jax.sharding.get_abstract_mesh(), ep.active_rules())
  return module.param(name, nn.with_logical_partitioning(init, axes), block, dtype)


@contextlib.contextmanager
def recording_tables():
  """Yields a dict that `table_param` fills while in this context: {parameter path (tuple of names): (logical
  axes, dimensions taken as blocks)} of every table the model declares (the train step traces the model's init
  in it to learn which parameters enter its per-device loop as blocks)."""
  token = _TABLES.set({})
  try:
    yield _TABLES.get()
  finally:
    _TABLES.reset(token)

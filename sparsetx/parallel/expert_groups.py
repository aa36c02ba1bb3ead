"""Expert groups: which devices share a sparse layer's units and tokens (the mesh axes of its units, of its tokens
and of a neuron table's d_model), and the shard_map over them. More: docs/modules.md."""

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from sparsetx.config import rule_axes
from sparsetx.parallel import per_device
from sparsetx.parallel.logical_rules import active_mesh_axes, active_rules, sized_axes, table_spec


def whole_units(n_here: int, logical_name: str) -> int:
  """The units of a table whose first dimension (named `logical_name`) holds `n_here` of them on this device:
  n_here times the already-manual mesh axes it is split over (the table's block, `block_shape`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if per_device.no_mesh(mesh):
    return n_here
  manual = per_device.manual_axes(mesh)
  return n_here * per_device.shards(mesh, [a for a in active_mesh_axes(mesh, logical_name) if a in manual])


@dataclasses.dataclass(frozen=True)
class ExpertGroup:
  """The mesh axes of the tokens (`batch`) and of a layer's units (`units`), sizes > 1 only."""

  mesh: object  # jax.sharding.AbstractMesh
  batch: tuple
  units: tuple
  split: tuple = ()  # mesh axes splitting a neuron table's d_model (the d-split gather, sparse_forms.py)

  @property
  def n_unit_shards(self) -> int:
    return per_device.shards(self.mesh, self.units)

  @property
  def n_token_shards(self) -> int:
    """Shards of the tokens this code sees: over the batch axes not already manual (inside the step's
    per-device microbatch loop, parallel/microbatches.py, the tokens are one device's along its manual axes)."""
    return per_device.shards(self.mesh, [a for a in self.batch if a not in per_device.manual_axes(self.mesh)])

  @property
  def token_spec(self) -> P:
    """Spec of a [tokens, ...] array split like the batch."""
    return P(self.batch or None)

  @property
  def unit_spec(self):
    """Mesh axes of a units dimension, for a table's PartitionSpec."""
    return self.units or None

  @property
  def split_spec(self):
    """Mesh axes of a table's d_model dimension, for its PartitionSpec."""
    return self.split or None


def expert_group(logical_name: str, n_units: int, n_tokens: int):
  """The ExpertGroup for units named `logical_name`, or None to run the plain computation.

  None when there is no mesh in the context, when the units' mesh axes have size 1, or when the
  tokens don't split evenly over the batch axes (e.g. a batch of 1 at init). Units split evenly:
  setup refused any config where they don't (models/ffn/placement.check_units_divide).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if per_device.no_mesh(mesh):
    return None
  rules = active_rules()
  group = ExpertGroup(
    mesh, sized_axes(mesh, rule_axes(rules, "batch")), sized_axes(mesh, rule_axes(rules, logical_name))
  )
  return _checked(group, n_units, n_tokens) if group.units else None


def _checked(group: ExpertGroup, n_units: int, n_tokens: int):
  """The group, or None if the tokens don't split; the units split, as setup checked (check_units_divide)."""
  assert n_units % group.n_unit_shards == 0, (
    f"{n_units} units over {group.n_unit_shards} devices: placement.check_units_divide should have refused this"
  )
  if n_tokens % group.n_token_shards:
    return None
  return group


def table_group(table_names, unit_name, n_units: int, n_tokens: int):
  """The ExpertGroup of a neuron table (sgatlin, PEER) as the rules lay it out, or None for the plain computation.

  The table's PartitionSpec comes from its logical names under the rules (flax's assignment, so it
  is the layout the parameter is stored in): `units` are the mesh axes of its `unit_name` dimension
  (None for PEER's shared table), `split` those of its last (d_model) dimension. With the default
  rules sgatlin's channels go to `expert` and d_model to `fsdp`, so a mesh expert=C x fsdp=S holds
  rows[:, c, :, d-slice] on each device; rules mapping `embed` to ("fsdp", "expert") put a table's
  d_model on the expert axis (PEER's form; with ("channel", None) before them, sgatlin's when the
  expert axis is larger than C).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if per_device.no_mesh(mesh):
    return None
  rules = active_rules()
  spec = table_spec(table_names, rules)
  units = sized_axes(mesh, spec[table_names.index(unit_name)]) if unit_name else ()
  group = ExpertGroup(mesh, sized_axes(mesh, rule_axes(rules, "batch")), units, sized_axes(mesh, spec[-1]))
  if not group.units and not group.split:
    return None
  return _checked(group, n_units, n_tokens)


def unit_index(group: ExpertGroup):
  """This device's position along the group's unit axes (major to minor), inside the shard_map."""
  index = 0
  for axis in group.units:
    index = index * group.mesh.shape[axis] + jax.lax.axis_index(axis)
  return index


def shard_map(fn, group: ExpertGroup, in_specs, out_specs, every_axis: bool = False):
  """jax.shard_map over the group's token and unit axes; the other mesh axes stay with the compiler, or with
  every_axis are manual too (replicated): kernels inside are single-device ops (Pallas TPU refuses a partly manual
  region).

  The tests compare values and gradients with the single-device layer on meshes whose batch is split over the
  expert axis too, and on meshes whose d_model split axis (tensor) does not split the batch.

  Axes already manual (the step's per-device microbatch loop, parallel/microbatches.py) are left out, with their entries
  in the specs: the arrays are already one device's along them, and the collectives of `fn` name them as they
  are. With every axis manual, `fn` runs as is, and its table gradients stay the device's own (summed over the
  data axes once per step, after the loop).
  """
  manual = per_device.manual_axes(group.mesh)
  axes = set(group.batch + group.units + group.split) - manual
  if not axes and not (every_axis and set(group.mesh.axis_names) - manual):
    return fn
  in_specs = jax.tree.map(lambda s: per_device.free_spec(s, group.mesh), in_specs, is_leaf=lambda s: isinstance(s, P))
  out_specs = jax.tree.map(lambda s: per_device.free_spec(s, group.mesh), out_specs, is_leaf=lambda s: isinstance(s, P))
  if every_axis:
    axes, in_specs, out_specs = per_device.every_axis_manual(group.mesh, axes, in_specs, out_specs)
  return per_device.shard_map(fn, group.mesh, in_specs, out_specs, axes)

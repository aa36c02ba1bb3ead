"""Expert parallelism: which devices share a sparse layer's units, and how tokens move between them.

More: docs/modules.md, sparsetx/parallel/expert_parallel.py.
"""

import contextlib
import contextvars
import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparsetx.config import DEFAULT_RULES, rule_axes
from sparsetx.parallel import per_device

# Put first in config.mesh.rules, these split every `embed` axis over fsdp x expert and keep channels whole:
# neuron tables (PEER's shared one; sgatlin's when the expert axis is larger than its channel count)
# are then split by d_model over the expert axis, and the layers run the d-split gather (sparse_forms.py).
D_MODEL_SPLIT_RULES = (("embed", ("fsdp", "expert")), ("channel", None))

_RULES = contextvars.ContextVar("sparsetx_logical_rules", default=DEFAULT_RULES)


@contextlib.contextmanager
def activate(mesh, rules=DEFAULT_RULES):
  """Mesh and logical rules in the context, so sparse layers trace their expert-parallel form."""
  token = _RULES.set(tuple(tuple(rule) for rule in rules))
  try:
    with jax.set_mesh(mesh):
      yield
  finally:
    _RULES.reset(token)


def active_rules() -> tuple:
  """The logical rules in the context (`activate`)."""
  return _RULES.get()


def per_device_axes(mesh, rules) -> tuple:
  """The batch axes (size > 1): the train step runs its microbatch loop per device along all of them
  (parallel/microbatches.py), so every gradient is reduced over them once per step, after the loop. Inside it the sparse
  layers hold their tables' blocks along these axes (`block_shape`) and every other parameter whole."""
  return sized_axes(mesh, rule_axes(rules, "batch"))


def block_shape(shape, names, local, mesh, rules) -> tuple:
  """The shape of this device's block of a table with logical axes `names`, stored as the rules lay it out
  (`table_spec`): each dimension named in `local` (those the dispatcher runs on as blocks: units, d_model of a
  neuron table) divided by the already-manual mesh axes it is split over. `shape` itself outside the step's
  per-device loop (no manual axes)."""
  if per_device.no_mesh(mesh):
    return tuple(shape)
  manual = per_device.manual_axes(mesh)
  spec = table_spec(names, rules)
  return tuple(
    n // math.prod(mesh.shape[a] for a in sized_axes(mesh, entry) if a in manual) if name in local else n
    for n, name, entry in zip(shape, names, spec)
  )


def whole_units(n_here: int, logical_name: str) -> int:
  """The units of a table whose first dimension (named `logical_name`) holds `n_here` of them on this device:
  n_here times the already-manual mesh axes it is split over (the table's block, `block_shape`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if per_device.no_mesh(mesh):
    return n_here
  manual = per_device.manual_axes(mesh)
  return n_here * math.prod(mesh.shape[a] for a in active_mesh_axes(mesh, logical_name) if a in manual)


@dataclasses.dataclass(frozen=True)
class ExpertGroup:
  """The mesh axes of the tokens (`batch`) and of a layer's units (`units`), sizes > 1 only."""

  mesh: object  # jax.sharding.AbstractMesh
  batch: tuple
  units: tuple
  split: tuple = ()  # mesh axes splitting a neuron table's d_model (the d-split gather, sparse_forms.py)

  @property
  def n_unit_shards(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.units)

  @property
  def n_token_shards(self) -> int:
    """Shards of the tokens this code sees: over the batch axes not already manual (inside the step's
    per-device microbatch loop, parallel/microbatches.py, the tokens are one device's along its manual axes)."""
    return math.prod(self.mesh.shape[a] for a in self.batch if a not in per_device.manual_axes(self.mesh))

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
  rules = _RULES.get()
  group = ExpertGroup(
    mesh, sized_axes(mesh, rule_axes(rules, "batch")), sized_axes(mesh, rule_axes(rules, logical_name))
  )
  return _checked(group, n_units, n_tokens) if group.units else None


def sized_axes(mesh, axes) -> tuple:
  """The mesh axes (a name, a tuple of names or None) of size > 1."""
  return tuple(a for a in per_device.axis_tuple(axes) if a in mesh.shape and mesh.shape[a] > 1)


def active_mesh_axes(mesh, logical_name: str) -> tuple:
  """The mesh axes of size > 1 that the active rules map `logical_name` to (e.g. 'batch', 'heads')."""
  return sized_axes(mesh, rule_axes(_RULES.get(), logical_name))


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
  rules = _RULES.get()
  spec = table_spec(table_names, rules)
  units = sized_axes(mesh, spec[table_names.index(unit_name)]) if unit_name else ()
  group = ExpertGroup(mesh, sized_axes(mesh, rule_axes(rules, "batch")), units, sized_axes(mesh, spec[-1]))
  if not group.units and not group.split:
    return None
  return _checked(group, n_units, n_tokens)


def table_spec(table_names, rules) -> tuple:
  """The mesh axes of each dimension of a table with these logical names (flax's assignment)."""
  spec = tuple(nn.logical_to_mesh_axes(table_names, tuple(tuple(rule) for rule in rules)))
  return spec + (None,) * (len(table_names) - len(spec))


def on_token_shards(a_BT, group: ExpertGroup):
  """Constrains a [B, T, ...] array to the batch layout, so the router runs where the tokens are.

  Without it the compiler may follow the router's channel-sharded keys and gather the scores of
  the whole batch onto every device.
  """
  B, T = a_BT.shape[:2]
  a_N = a_BT.reshape((B * T,) + a_BT.shape[2:])
  spec = per_device.free_spec(group.token_spec, group.mesh)
  if any(spec):
    a_N = jax.lax.with_sharding_constraint(a_N, jax.sharding.NamedSharding(group.mesh, spec))
  return a_N.reshape(a_BT.shape)


def gather_tokens(x_n, group: ExpertGroup):
  """[local tokens, ...] -> [group tokens, ...]: all-gather over the unit axes that split the batch.

  Its transpose (the gradient) reduce-scatters in float32, like `scatter_back`.
  """
  axes = tuple(a for a in group.units if a in group.batch)
  if not axes or not jnp.issubdtype(x_n.dtype, jnp.floating):
    return all_gather(x_n, axes)
  return _gather_f32_grad(x_n, axes)


def all_gather(x_n, axes):
  """[tokens, ...] -> [tokens of every device along `axes`, ...] (tiled all-gathers, major axis first)."""
  for axis in axes:
    x_n = jax.lax.all_gather(x_n, axis, axis=0, tiled=True)
  return x_n


def _reduce_scatter(y_g, axes):
  for axis in reversed(axes):
    y_g = jax.lax.psum_scatter(y_g, axis, scatter_dimension=0, tiled=True)
  return y_g


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_f32_grad(x_n, axes):
  return all_gather(x_n, axes)


def _gather_fwd(x_n, axes):
  return all_gather(x_n, axes), jnp.zeros((), x_n.dtype)


def _gather_bwd(axes, dtype_probe, dy_g):
  return (_reduce_scatter(dy_g.astype(jnp.float32), axes).astype(dtype_probe.dtype),)


_gather_f32_grad.defvjp(_gather_fwd, _gather_bwd)


def to_owners(a_nU, group: ExpertGroup, unit_dim: int, axes: tuple | None = None):
  """[local tokens, all units, ...] -> [group tokens, local units, ...] (all-to-all or local slice).

  Over `axes` (default: the group's unit axes); the d-split gather (sparse_forms.py) passes the split axes to send
  x's d-slices ([tokens, D] -> [d-group tokens, D / S]) the same way.
  """
  for axis in group.units if axes is None else axes:
    if axis in group.batch:
      a_nU = jax.lax.all_to_all(a_nU, axis, split_axis=unit_dim, concat_axis=0, tiled=True)
    else:
      size = a_nU.shape[unit_dim] // group.mesh.shape[axis]
      a_nU = jax.lax.dynamic_slice_in_dim(a_nU, jax.lax.axis_index(axis) * size, size, axis=unit_dim)
  return a_nU


def from_owners(a_gU, group: ExpertGroup, unit_dim: int, axes: tuple | None = None):
  """The inverse of `to_owners` (same `axes`): [group tokens, local units, ...] -> [local tokens, all units, ...]."""
  for axis in reversed(group.units if axes is None else axes):
    if axis in group.batch:
      a_gU = jax.lax.all_to_all(a_gU, axis, split_axis=0, concat_axis=unit_dim, tiled=True)
    else:
      a_gU = jax.lax.all_gather(a_gU, axis, axis=unit_dim, tiled=True)
  return a_gU


def scatter_back(y_g, group: ExpertGroup, out_dtype=None):
  """Sums partial outputs over the group and returns each device its own tokens (reduce-scatter).

  The sum is float32, as the single-device kernels accumulate (and XLA:CPU aborts compiling a
  bf16 reduce-scatter of the gated gather's output); the caller casts the result, or names the
  dtype it casts to (`out_dtype`), which is then cast here. The cotangent of an output cast to a
  narrower dtype holds values of that dtype, so the backward's all-gather of dy moves them in it:
  the same values in half the bytes (docs/expert_parallel.md, dtypes on the wire).
  """
  narrow = out_dtype is not None and jnp.dtype(out_dtype).itemsize < 4
  if narrow and all(axis in group.batch for axis in group.units):
    return _scatter_back_narrow_grad(y_g.astype(jnp.float32), group, jnp.dtype(out_dtype))
  y_g = _scatter_back_f32(y_g, group)
  return y_g if out_dtype is None else y_g.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _scatter_back_narrow_grad(y_g, group, dtype):
  return _reduce_scatter(y_g, group.units).astype(dtype)


def _scatter_back_narrow_fwd(y_g, group, dtype):
  return _scatter_back_narrow_grad(y_g, group, dtype), None


def _scatter_back_narrow_bwd(group, dtype, _, dy_n):
  return (all_gather(dy_n.astype(dtype), group.units).astype(jnp.float32),)


_scatter_back_narrow_grad.defvjp(_scatter_back_narrow_fwd, _scatter_back_narrow_bwd)


def _scatter_back_f32(y_g, group: ExpertGroup):
  y_g = y_g.astype(jnp.float32)
  for axis in reversed(group.units):
    if axis in group.batch:
      y_g = jax.lax.psum_scatter(y_g, axis, scatter_dimension=0, tiled=True)
    else:
      y_g = jax.lax.psum(y_g, axis)
  return y_g


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

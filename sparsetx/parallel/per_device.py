"""Running code on each device of a mesh: the one place a shard_map is built, and what every such site asks first
(is there a mesh, which axes are manual already, an axis entry as a tuple, how many shards the batch takes).

A shard_map here runs with check_vma off: the kernels' scans start float32 accumulators from zeros, which the
varying-axes check rejects inside a shard_map; the tests compare values and gradients with the single-device forms
instead. A region with every free axis manual also names the free axes of size 1 that split nothing, so that no
gradient is summed over them (a shard_map transposes an axis its specs do not name into an all-reduce).
"""

import math

import jax
from jax.sharding import PartitionSpec as P


def no_mesh(mesh) -> bool:
  """Whether there is no mesh to run over: none in the context, or an empty abstract mesh."""
  return mesh is None or mesh.empty


def axis_tuple(entry) -> tuple:
  """A PartitionSpec entry or rule value (None, a mesh axis name or a tuple of them) as a tuple of axis names."""
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def manual_axes(mesh) -> frozenset:
  """The mesh axes already manual here: those of an enclosing shard_map (the step's per-device loop)."""
  return frozenset(getattr(mesh, "manual_axes", ()))


def shards(mesh, axes) -> int:
  """How many pieces the mesh axes `axes` cut a dimension into (1 without a mesh)."""
  return 1 if no_mesh(mesh) else math.prod(mesh.shape[a] for a in axis_tuple(axes))


def free_spec(spec: P, mesh) -> P:
  """`spec` without the axes already manual: what a nested shard_map or a sharding constraint may name (the
  arrays there are already one device's along those axes)."""
  manual = manual_axes(mesh)
  if not manual:
    return spec
  return P(*(tuple(a for a in axis_tuple(entry) if a not in manual) or None for entry in spec))


def every_axis_manual(mesh, used: set, in_specs, out_specs):
  """(axis_names, in_specs, out_specs) of a shard_map that makes every free mesh axis manual, as a Mosaic kernel
  inside requires (it refuses a partly manual region). The free axes of size 1 that split nothing here are named on
  each array's first dimension: splitting by them changes nothing, and a shard_map transposes an axis its specs do
  not name into a sum over it (a no-op all-reduce per gradient, inside a micro-batch loop too)."""
  free = set(mesh.axis_names) - manual_axes(mesh)
  idle = tuple(a for a in mesh.axis_names if a in free and a not in used and mesh.shape[a] == 1)

  def named(spec):
    if not idle:
      return spec
    first = axis_tuple(spec[0] if len(spec) else None)
    return P(first + idle, *spec[1:])

  def each(specs):
    return jax.tree.map(named, specs, is_leaf=lambda s: isinstance(s, P))

  return free, each(in_specs), each(out_specs)


def shard_map(fn, mesh, in_specs, out_specs, axes):
  """fn run on each device's blocks, manual over the mesh axes `axes` (the others stay with the compiler)."""
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes), check_vma=False)

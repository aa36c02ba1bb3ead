"""Where a fused attention kernel runs on a mesh: each device on its own rows and heads.

The Pallas kernels (splash on TPU, the Triton flash attention on GPU) have no partitioning rule, so under a mesh
the compiler would gather every row onto every device; `per_device` runs them in a shard_map over the mesh axes
of the logical `batch` and `heads` axes instead (sparsetx/models/attention.py calls it, so the model knows no
mesh). cuDNN's call has a partitioning rule, but it fails (an AssertionError in XLA's GPU compile) inside the
train step's micro-batch loop, a region already manual over the batch axes; it comes here too. Inside such a
region every remaining axis is made manual, even with nothing to split: Mosaic kernels refuse a partially
manual region, and partitioning rules are not run there.
"""

import math

import jax
from jax.sharding import PartitionSpec as P

from sparsetx.parallel import expert_parallel


def per_device(fn, q_BTHK, k_BTHK, v_BTHK, segment_ids_BT):
  """fn(q, k, v, segment_ids) -> out [B,T,H,K] on each device's rows and heads: a shard_map over the mesh axes of
  `batch` and `heads` (those whose sizes divide B and H) when a mesh is active, fn itself otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return fn(q_BTHK, k_BTHK, v_BTHK, segment_ids_BT)
  B, _, H, _ = q_BTHK.shape

  def dividing(name: str, size: int) -> tuple:
    axes = tuple(a for a in expert_parallel.active_mesh_axes(mesh, name) if a not in mesh.manual_axes)
    return axes if axes and size % math.prod(mesh.shape[a] for a in axes) == 0 else ()

  batch, heads = dividing("batch", B), dividing("heads", H)
  heads = tuple(a for a in heads if a not in batch)
  if not batch and not heads and not mesh.manual_axes:
    return fn(q_BTHK, k_BTHK, v_BTHK, segment_ids_BT)
  spec_BTHK, spec_BT = P(batch or None, None, heads or None, None), P(batch or None, None)
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=(spec_BTHK,) * 3 + (spec_BT,),
    out_specs=spec_BTHK,
    # Every free axis manual (the others replicate): Pallas TPU refuses a partially manual region.
    axis_names=set(mesh.axis_names) - set(mesh.manual_axes),
    check_vma=False,
  )(q_BTHK, k_BTHK, v_BTHK, segment_ids_BT)

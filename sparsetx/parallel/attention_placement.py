"""Where a fused attention kernel runs on a mesh: each device on its own rows and heads.

The Pallas kernels (splash on TPU, the Triton flash attention on GPU) have no partitioning rule, so under a mesh
the compiler would gather every row onto every device; `on_own_rows_and_heads` runs them in a shard_map over the mesh axes
of the logical `batch` and `heads` axes instead (sparsetx/models/attention.py calls it, so the model knows no
mesh). cuDNN's call has a partitioning rule, but it fails (an AssertionError in XLA's GPU compile) inside the
train step's micro-batch loop, a region already manual over the batch axes; it comes here too. Inside such a
region every remaining axis is made manual, even with nothing to split: Mosaic kernels refuse a partially
manual region, and partitioning rules are not run there.
"""

import jax
from jax.sharding import PartitionSpec as P

from sparsetx.parallel import logical_rules, per_device


def on_own_rows_and_heads(fn, q_BTHK, k_BTHK, v_BTHK, segment_ids_BT):
  """fn(q, k, v, segment_ids) -> out [B,T,H,K] on each device's rows and heads: a shard_map over the mesh axes of
  `batch` and `heads` (those whose sizes divide B and H) when a mesh is active, fn itself otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  if per_device.no_mesh(mesh):
    return fn(q_BTHK, k_BTHK, v_BTHK, segment_ids_BT)
  B, _, H, _ = q_BTHK.shape
  manual = per_device.manual_axes(mesh)

  def dividing(name: str, size: int) -> tuple:
    axes = tuple(a for a in logical_rules.active_mesh_axes(mesh, name) if a not in manual)
    return axes if axes and size % per_device.shards(mesh, axes) == 0 else ()

  batch, heads = dividing("batch", B), dividing("heads", H)
  heads = tuple(a for a in heads if a not in batch)
  if not batch and not heads and not manual:
    return fn(q_BTHK, k_BTHK, v_BTHK, segment_ids_BT)
  spec_BTHK, spec_BT = P(batch or None, None, heads or None, None), P(batch or None, None)
  # Every free axis manual (Pallas TPU refuses a partially manual region), the idle ones named (no no-op sums).
  axes, in_specs, out_spec = per_device.every_axis_manual(
    mesh, set(batch + heads), (spec_BTHK,) * 3 + (spec_BT,), spec_BTHK
  )
  return per_device.shard_map(fn, mesh, in_specs, out_spec, axes)(q_BTHK, k_BTHK, v_BTHK, segment_ids_BT)

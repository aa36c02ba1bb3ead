"""The micro-batch loop run per device along every batch axis, so each gradient is reduced once per step.

In the compiler's loop every gradient is reduced over the batch's devices inside each micro-batch (it is added to a
carry laid out like the parameter), and FSDP's gather-transpose reduce-scatters there too. Here the loop runs in a
shard_map manual over the batch axes: each device accumulates its own tokens' gradients, reduced once after the loop.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparsetx.parallel import logical_rules, per_device
from sparsetx.parallel import tables as tables_lib


def loop_axes(microbatches: int, rows: int, mesh, rules) -> tuple:
  """The batch axes the micro-batch loop runs per device along: every batch axis with microbatches > 1 on a mesh;
  none (the compiler's loop) when each micro-batch's `rows` of the global batch do not split over their devices."""
  if microbatches == 1 or per_device.no_mesh(mesh):
    return ()
  axes = logical_rules.per_device_axes(mesh, rules)
  return axes if (rows // microbatches) % per_device.shards(mesh, axes) == 0 else ()


def accumulate(device_loss, init_model, params, batch, microbatches, mesh, axes, param_specs, constants=()):
  """(loss sum, weight sum, gradients, stats) of the global batch in `microbatches` row blocks, per device.

  device_loss(n_devices, gather, params, microbatch) -> (summed loss, (weight sum, stats)) of one device's rows;
  `gather` all-gathers a per-token value over `axes` (for terms that need the whole micro-batch). init_model()
  traces the model's init (the tables it declares, `_loop_specs`). check_vma is off, so every value is the
  device's own and the step's loss is the sum of the devices' losses.

  Parameters enter as `_loop_specs` gives: the sparse layers' tables as this device's blocks along the axes their
  dispatcher splits them over (its collectives run inside the loop on the manual axes; the tables never move),
  every other parameter whole along `axes` (an FSDP- or expert-split one all-gathered once, before the loop).
  `constants` (a tuple of replicated pytrees: what the loss reads but is not differentiated by) enter whole and
  follow the microbatch in device_loss's arguments.
  """
  n_devices = per_device.shards(mesh, axes)
  gather = functools.partial(jax.lax.all_gather, axis_name=axes, axis=0, tiled=True)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  stored = treedef.flatten_up_to(param_specs)
  loop = _loop_specs(init_model, leaves, stored, axes)

  def on_device(params, micro, constants):
    loss = lambda params, microbatch: device_loss(n_devices, gather, params, microbatch, *constants)  # noqa: E731
    loss_sum, weight_sum, grads, stats = sum_over(jax.value_and_grad(loss, has_aux=True), params, micro)
    # The step's one reduction of each gradient, over every batch axis but its blocks'.
    reduced = [_reduce_once(g, spec, block, axes) for g, spec, block in zip(jax.tree.leaves(grads), stored, loop)]
    loss_sum, weight_sum = jax.lax.psum((loss_sum, weight_sum), axes)
    return loss_sum, weight_sum, treedef.unflatten(reduced), stats

  # The micro-batches are the global batch's row blocks, as in the compiler's loop (the same tokens per micro-batch,
  # so the same balancing losses and stats); each device takes its rows of each.
  micro = split(batch, microbatches)
  grad_specs = treedef.unflatten([_manual_spec(spec, axes) for spec in stored])
  in_specs = (treedef.unflatten(loop), P(None, axes), P())
  return per_device.shard_map(on_device, mesh, in_specs, (P(), P(), grad_specs, P()), axes)(params, micro, constants)


def sum_over(grad_fn, params, micro):
  """(loss sum, weight sum, gradient sums, stats averaged) over the micro-batches `micro` (a leading axis) by one
  scan: grad_fn(params, microbatch) -> ((summed loss, (weight sum, stats)), gradients). The loop of both paths:
  the compiler's (whole micro-batches) and the per-device one (a device's rows of each, in `accumulate`)."""

  def step(carry, microbatch):
    (loss_sum, (weight_sum, stats)), grads = grad_fn(params, microbatch)
    total_loss, total_weight, total_grads = carry
    return (total_loss + loss_sum, total_weight + weight_sum, jax.tree.map(jnp.add, total_grads, grads)), stats

  zeros = jax.tree.map(jnp.zeros_like, params)
  (loss_sum, weight_sum, grads), stats = jax.lax.scan(step, (0.0, 0.0, zeros), micro)
  return loss_sum, weight_sum, grads, jax.tree.map(lambda s: s.mean(0), stats)  # stats: the micro-batches' mean


def split(batch, microbatches: int):
  """The batch as [microbatches, rows / microbatches, ...] row blocks."""
  return jax.tree.map(lambda x: x.reshape((microbatches, x.shape[0] // microbatches) + x.shape[1:]), batch)


def loop_param_bytes(init_model, abstract_params, mesh, axes) -> int:
  """Bytes one device holds of the parameters as the loop along `axes` takes them (the tables' blocks, every other
  parameter whole along the batch axes), or as stored without the loop (no axes). Its gradient sum has this size
  too: the device memory estimate (measure/aot.py) counts both."""
  leaves = jax.tree_util.tree_leaves_with_path(abstract_params)
  stored = [leaf.sharding.spec for _, leaf in leaves]
  loop = _loop_specs(init_model, leaves, stored, axes) if axes else stored
  total = 0
  for (_, leaf), spec, block in zip(leaves, stored, loop):
    pad = (None,) * leaf.ndim
    # Split along a dimension: the axes the loop leaves to the compiler, and the block's manual ones.
    split_by = [
      {a for a in per_device.axis_tuple(e) if a not in axes} | set(per_device.axis_tuple(b))
      for e, b in zip(tuple(spec) + pad, tuple(block) + pad)
    ]
    total += math.prod(n // per_device.shards(mesh, s) for n, s in zip(leaf.shape, split_by)) * leaf.dtype.itemsize
  return total


def _manual_spec(spec: P, axes) -> P:
  """`spec` restricted to the manual axes `axes` (what a shard_map manual over them may name)."""
  return P(*(tuple(a for a in per_device.axis_tuple(entry) if a in axes) or None for entry in spec))


def _loop_specs(init_model, leaves, stored, axes) -> list:
  """Each parameter's spec entering the loop: a table's (`tables.table_param`, found in the model's traced init by
  `tables.declared_tables`) keeps the manual axes of the dimensions its dispatcher takes as blocks; every other
  parameter is whole along the manual axes."""
  recorded = tables_lib.declared_tables(jax.eval_shape(init_model)["params"])
  specs = []
  for (path, leaf), spec in zip(leaves, stored):
    names, local = recorded.get(tuple(getattr(k, "key", k) for k in path), ((None,) * leaf.ndim, ()))
    entries = tuple(spec) + (None,) * (leaf.ndim - len(spec))
    specs.append(_manual_spec(P(*(e if name in local else None for e, name in zip(entries, names))), axes))
  return specs


def _reduce_once(g, spec: P, block: P, axes):
  """A device's accumulated gradient of a parameter stored as `spec` that entered the loop as `block`, summed over
  the devices of `axes`: reduce-scattered along each dimension the stored layout splits over manual axes the block
  does not (so it leaves as stored), then all-reduced over the manual axes left; nothing over the block's axes."""
  blocks = {a for entry in block for a in per_device.axis_tuple(entry)}
  scatters = [
    (dim, entry)
    for dim, (entry, taken) in enumerate(zip(_manual_spec(spec, axes), tuple(block) + (None,) * len(spec)))
    if entry and not taken
  ]
  rest = tuple(a for a in axes if a not in blocks and all(a not in entry for _, entry in scatters))
  for dim, entry in scatters:
    g = jax.lax.psum_scatter(g, entry, scatter_dimension=dim, tiled=True)
  if scatters and rest:
    # Scattered first, so the all-reduce moves 1/S of the gradient. The barrier keeps the two apart: without it the
    # CPU program (jax 0.10.2) gave every block the sum of all blocks (the router keys' gradient on data=2 x
    # expert=4, tests/test_gradient_reduction.py), though the HLO reads right.
    g = jax.lax.optimization_barrier(g)
  return jax.lax.psum(g, rest) if rest else g

"""How tokens move within an expert group: gathered to the units' devices, routing data sent to the units' owners
and back, partial outputs summed back to the tokens' owners; with the gradients' dtypes on the wire chosen here."""

import functools

import jax
import jax.numpy as jnp

from sparsetx.parallel.expert_groups import ExpertGroup


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

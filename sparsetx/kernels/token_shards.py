"""Pallas kernels on a mesh: each device runs the gated gather's token-side kernels on its own tokens.

More: docs/modules.md, sparsetx/kernels/token_shards.py.
"""

import contextlib
import contextvars
import math

import jax
from jax.sharding import PartitionSpec as P

from sparsetx.config import DEFAULT_RULES, rule_axes

_TOKEN_AXES = contextvars.ContextVar("sparsetx_token_axes", default=None)  # None: the default rules' `batch`


@contextlib.contextmanager
def token_axes(axes):
  """In this context the kernels' per-token operands are split over these mesh axes (those present, size > 1)."""
  token = _TOKEN_AXES.set(tuple(axes))
  try:
    yield
  finally:
    _TOKEN_AXES.reset(token)


def _over_token_shards(fn, per_token, args, summed):
  """fn(*args) in a shard_map over every free mesh axis, the per-token args split over the token axes among them.

  Results are per token, or (summed) sums over tokens: each device's partial result summed over those axes."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return fn(*args)
  free = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
  if not free:
    return fn(*args)
  axes = _TOKEN_AXES.get()
  axes = rule_axes(DEFAULT_RULES, "batch") if axes is None else axes
  batch = tuple(a for a in axes if a in free and mesh.shape[a] > 1)
  n_tokens = next(a.shape[0] for a, split in zip(args, per_token) if split)
  if not batch or n_tokens % math.prod(mesh.shape[a] for a in batch):
    batch = ()  # tokens that do not split evenly stay whole on every device
  tokens = P(batch) if batch else P()
  in_specs = tuple(tokens if split else P() for split in per_token)
  if summed and batch:
    local = lambda *a: jax.tree.map(lambda r: jax.lax.psum(r, batch), fn(*a))  # noqa: E731
  else:
    local = fn
  out_specs = P() if summed else tokens
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(free), check_vma=False)(
    *args
  )


def on_token_shards(fn, per_token, *args):
  """fn(*args), each device on its own tokens: args[i] is split along its leading (token) dimension where
  per_token[i] is true and passed whole otherwise (None passes through); every result is per token."""
  return _over_token_shards(fn, per_token, args, summed=False)


def summed_over_token_shards(fn, per_token, *args):
  """fn(*args) for results that are sums over tokens (table gradients): each device sums its own tokens' terms
  and the partial results are summed over the token axes (the data-parallel gradient all-reduce)."""
  return _over_token_shards(fn, per_token, args, summed=True)

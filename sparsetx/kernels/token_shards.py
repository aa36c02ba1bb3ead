"""Pallas kernels on a mesh: each device runs the gated gather's token-side kernels on its own tokens.

A Pallas kernel is a custom call that XLA cannot partition: Pallas TPU lowers one only where every mesh axis
is manual ("Mosaic kernels cannot be automatically partitioned"), and XLA would run a GPU kernel whole on
every device, for every token. The gated gather's kernels work per token and read the tables whole, so
`on_token_shards` runs them in a `jax.shard_map` over every mesh axis not manual yet (inside an
expert-parallel shard_map, sparsetx/parallel/dispatch.py, the group's axes already are): per-token operands and all
results are split over the batch's axes (config.mesh.rules' `batch`) among those, and the tables enter whole
on every device (under fsdp, the all-gather XLA adds is the one the layer's dense weights get too). Other
axes (tensor) hold the same tokens and compute the same values. Tokens that do not split evenly stay whole.
Without a mesh of more than one device the call is unchanged.

Which mesh axes split the tokens is the parallel layer's knowledge (its logical rules); it tells this module
with `token_axes`, which `sparsetx.parallel.expert_parallel.activate` enters with the rules' `batch` axes.
Outside it the default rules' `batch` axes apply.
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

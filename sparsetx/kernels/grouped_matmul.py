"""MoE's grouped matmul: out[s] = lhs[s] @ rhs[group(s)] for rows sorted by group (group_sizes rows each), with
its two gradients, each computed only over the rows routed to each group. Its implementations, and the order they
are tried in, are kernels/registry.py's `grouped_matmul` table (grouped_ops.py).

More: docs/modules.md, sparsetx/kernels/grouped_matmul.py.
"""

import jax.numpy as jnp

from sparsetx.kernels import registry
from sparsetx.kernels.grouped_ops import ragged_dot  # noqa: F401 (the XLA op, for callers and tests)
from sparsetx.kernels.options import KernelOptions


def implementation(options: KernelOptions, lhs_SK, rhs_EKN):
  """The grouped-matmul implementation that runs this call."""
  E, K, N = rhs_EKN.shape
  call = dict(dtype=jnp.dtype(lhs_SK.dtype).name, k=K, n=N, experts=E, rows=lhs_SK.shape[0])
  return registry.resolve("grouped_matmul", options, registry.grouped_shape_class(lhs_SK.dtype, K, N, E), call)


def grouped_matmul(lhs_SK, rhs_EKN, group_sizes_E, options: KernelOptions = KernelOptions()):
  """[S, N] in lhs's dtype: lhs[s] @ rhs[g] for the group_sizes_E[g] rows of group g (rows sorted by group; rows
  after the last group give zeros). Differentiable in lhs and rhs."""
  return implementation(options, lhs_SK, rhs_EKN)(lhs_SK, rhs_EKN, group_sizes_E, options)

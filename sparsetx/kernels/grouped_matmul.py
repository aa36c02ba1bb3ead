"""MoE's grouped matmul: out[s] = lhs[s] @ rhs[group(s)] for rows sorted by group (group_sizes rows each), with
its two gradients, each computed only over the rows routed to each group. Its implementations, and the order they
are tried in, are kernels/registry.py's `grouped_matmul` table (grouped_ops.py).

More: docs/modules.md, sparsetx/kernels/grouped_matmul.py.
"""

from sparsetx.kernels import op_calls, registry
from sparsetx.kernels.grouped_ops import ragged_dot  # noqa: F401 (the XLA op, for callers and tests)
from sparsetx.kernels.options import KernelOptions


def implementation(options: KernelOptions, lhs_SK, rhs_EKN):
  """The grouped-matmul implementation that runs this call."""
  call = op_calls.grouped(lhs_SK, rhs_EKN)
  return registry.resolve("grouped_matmul", options, op_calls.shape_class(call), call)


def grouped_matmul(lhs_SK, rhs_EKN, group_sizes_E, options: KernelOptions = KernelOptions()):
  """[S, N] in lhs's dtype: lhs[s] @ rhs[g] for the group_sizes_E[g] rows of group g (rows sorted by group; rows
  after the last group give zeros). Differentiable in lhs and rhs."""
  return implementation(options, lhs_SK, rhs_EKN)(lhs_SK, rhs_EKN, group_sizes_E, options)

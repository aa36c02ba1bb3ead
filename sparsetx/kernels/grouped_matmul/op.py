"""MoE's grouped matmul: out[s] = lhs[s] @ rhs[group(s)] for rows sorted by group (group_sizes rows each), with
its two gradients, each computed only over the rows routed to each group. An implementation is a (gmm, tgmm) pair
of kernels under this module's one custom VJP, or XLA's ragged_dot; grouped_matmul/table.py lists them, and
kernels/registry.py picks the one that runs a call.

  gmm:   out[s]  = lhs[s] @ rhs[g(s)]       (forward; with rhs read transposed, the input gradient)
  tgmm:  drhs[e] = sum_{s in e} outer(lhs[s], dout[s])           (the weights' gradient)

More: docs/modules.md, sparsetx/kernels/grouped_matmul/op.py.
"""

import functools

import jax
import jax.numpy as jnp

from sparsetx.kernels import op_calls, registry
from sparsetx.kernels.options import KernelOptions


def implementation(options: KernelOptions, lhs_SK, rhs_EKN):
  """The grouped-matmul implementation that runs this call."""
  call = op_calls.grouped(lhs_SK, rhs_EKN)
  return registry.resolve("grouped_matmul", options, op_calls.shape_class(call), call)


def grouped_matmul(lhs_SK, rhs_EKN, group_sizes_E, options: KernelOptions = KernelOptions()):
  """[S, N] in lhs's dtype: lhs[s] @ rhs[g] for the group_sizes_E[g] rows of group g (rows sorted by group; rows
  after the last group give zeros). Differentiable in lhs and rhs."""
  return run(implementation(options, lhs_SK, rhs_EKN), lhs_SK, rhs_EKN, group_sizes_E, options)


def run(implementation, lhs_SK, rhs_EKN, group_sizes_E, options: KernelOptions):
  """The op with one implementation (grouped_matmul/interface.py): its (gmm, tgmm) kernels under the custom VJP,
  or XLA's ragged_dot where it has none."""
  kernels = implementation.kernels(options)
  if kernels is None:
    return ragged_dot(lhs_SK, rhs_EKN, group_sizes_E)
  return _grouped(kernels, options, lhs_SK, rhs_EKN, group_sizes_E.astype(jnp.int32))


def ragged_dot(lhs_SK, rhs_EKN, group_sizes_E):
  """The XLA op: jax.lax.ragged_dot with float32 sums, rounded to lhs's dtype."""
  out = jax.lax.ragged_dot(lhs_SK, rhs_EKN.astype(lhs_SK.dtype), group_sizes_E, preferred_element_type=jnp.float32)
  return out.astype(lhs_SK.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped(kernels, options, lhs_SK, rhs_EKN, group_sizes_E):
  gmm, _ = kernels
  return gmm(lhs_SK, rhs_EKN, group_sizes_E, False, options)


def _grouped_fwd(kernels, options, lhs_SK, rhs_EKN, group_sizes_E):
  return _grouped(kernels, options, lhs_SK, rhs_EKN, group_sizes_E), (lhs_SK, rhs_EKN, group_sizes_E)


def _grouped_bwd(kernels, options, residuals, dout_SN):
  gmm, tgmm = kernels
  lhs_SK, rhs_EKN, group_sizes_E = residuals
  dout_SN = dout_SN.astype(lhs_SK.dtype)
  dlhs_SK = gmm(dout_SN, rhs_EKN, group_sizes_E, True, options)
  drhs_EKN = tgmm(lhs_SK, dout_SN, group_sizes_E, options).astype(rhs_EKN.dtype)
  return dlhs_SK, drhs_EKN, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)

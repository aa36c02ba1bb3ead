"""MoE's grouped matmul: out[s] = lhs[s] @ rhs[group(s)] for rows sorted by group (group_sizes rows each), with
its two gradients, each computed only over the rows routed to each group.

  gmm:   out[s]  = lhs[s] @ rhs[g(s)]       (forward; with rhs read transposed, the input gradient)
  tgmm:  drhs[e] = sum_{s in e} outer(lhs[s], dout[s])           (the weights' gradient)

More: docs/modules.md, sparsetx/kernels/grouped_matmul.py.
"""

import functools

import jax
import jax.numpy as jnp

from sparsetx.kernels import platform
from sparsetx.kernels.device import target
from sparsetx.kernels.options import KernelOptions


def ragged_dot(lhs_SK, rhs_EKN, group_sizes_E):
  """The XLA op: jax.lax.ragged_dot with float32 sums, rounded to lhs's dtype."""
  out = jax.lax.ragged_dot(lhs_SK, rhs_EKN.astype(lhs_SK.dtype), group_sizes_E, preferred_element_type=jnp.float32)
  return out.astype(lhs_SK.dtype)


def kernels(options: KernelOptions, lhs_SK, rhs_EKN):
  """(gmm, tgmm) of the backend that runs this call, or None where `ragged_dot` is the op (xla on a GPU or TPU)."""
  device = target()
  implementation = options.implementation
  if implementation == "auto":
    implementation = "xla" if device.platform == "cpu" else "pallas"
  if implementation == "reference" or (implementation == "xla" and device.platform != "cpu"):
    return None
  if device.platform == "tpu":
    from sparsetx.kernels import grouped_tpu

    return grouped_tpu.gmm, grouped_tpu.tgmm
  if implementation == "xla":
    from sparsetx.kernels import grouped_xla

    return grouped_xla.gmm, grouped_xla.tgmm
  from sparsetx.kernels import grouped_triton

  if platform.gpu_kernel(options, device, "grouped_matmul") == "mosaic":
    from sparsetx.kernels import grouped_mosaic

    if grouped_mosaic.eligible(lhs_SK, rhs_EKN, options):
      return grouped_mosaic.gmm, grouped_triton.tgmm
  return grouped_triton.gmm, grouped_triton.tgmm


def grouped_matmul(lhs_SK, rhs_EKN, group_sizes_E, options: KernelOptions = KernelOptions()):
  """[S, N] in lhs's dtype: lhs[s] @ rhs[g] for the group_sizes_E[g] rows of group g (rows sorted by group; rows
  after the last group give zeros). Differentiable in lhs and rhs."""
  backend = kernels(options, lhs_SK, rhs_EKN)
  if backend is None:
    return ragged_dot(lhs_SK, rhs_EKN, group_sizes_E)
  return _grouped(backend, options, lhs_SK, rhs_EKN, group_sizes_E.astype(jnp.int32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped(backend, options, lhs_SK, rhs_EKN, group_sizes_E):
  gmm, _ = backend
  return gmm(lhs_SK, rhs_EKN, group_sizes_E, False, options)


def _grouped_fwd(backend, options, lhs_SK, rhs_EKN, group_sizes_E):
  return _grouped(backend, options, lhs_SK, rhs_EKN, group_sizes_E), (lhs_SK, rhs_EKN, group_sizes_E)


def _grouped_bwd(backend, options, residuals, dout_SN):
  gmm, tgmm = backend
  lhs_SK, rhs_EKN, group_sizes_E = residuals
  dout_SN = dout_SN.astype(lhs_SK.dtype)
  dlhs_SK = gmm(dout_SN, rhs_EKN, group_sizes_E, True, options)
  drhs_EKN = tgmm(lhs_SK, dout_SN, group_sizes_E, options).astype(rhs_EKN.dtype)
  return dlhs_SK, drhs_EKN, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)

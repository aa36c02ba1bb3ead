"""The grouped matmul on TPU: XLA:TPU's native ragged dot for the forward and the input gradient, and the pinned
JAX's megablox `tgmm` (a Pallas TPU kernel over row tiles that each belong to one group) for the weights'
gradient, which XLA:TPU would otherwise roll out over every group (E x rows x K x N). Same contract as
grouped_xla.py.

megablox tiles rows along the lanes of its transposed lhs, so rows come in LANES-row tiles (padding rows belong
to no group), and K and N in tiles of at most LANES (a whole dimension when smaller).
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox.gmm import tgmm as megablox_tgmm

from sparsetx.kernels import device

LANES = 128


def gmm(lhs_SK, rhs_EKN, group_sizes_E, transpose_rhs, options):
  """[S, N] in lhs's dtype: lhs[s] @ rhs[group(s)] (.T with transpose_rhs), float32 sums; rows after the last group
  are zeros."""
  rhs_EKN = rhs_EKN.astype(lhs_SK.dtype)
  if transpose_rhs:
    rhs_EKN = jnp.swapaxes(rhs_EKN, 1, 2)
  out = jax.lax.ragged_dot(lhs_SK, rhs_EKN, group_sizes_E, preferred_element_type=jnp.float32)
  return out.astype(lhs_SK.dtype)


def tgmm(lhs_SK, dout_SN, group_sizes_E, options):
  """[E, K, N] in lhs's dtype: sum over group e's rows s of outer(lhs[s], dout[s]), float32 sums (empty group:
  zeros; rows after the last group are left out)."""
  (n_rows, K), N = lhs_SK.shape, dout_SN.shape[1]
  pad = -n_rows % LANES
  lhs_KS = jnp.pad(lhs_SK, ((0, pad), (0, 0))).T
  dout_SN = jnp.pad(dout_SN, ((0, pad), (0, 0)))
  sums_EKN = megablox_tgmm(
    lhs_KS,
    dout_SN,
    group_sizes_E,
    preferred_element_type=jnp.float32,
    tiling=(LANES, min(LANES, K), min(LANES, N)),
    interpret=device.interpret_off("tpu", options),
  )
  return sums_EKN.astype(lhs_SK.dtype)

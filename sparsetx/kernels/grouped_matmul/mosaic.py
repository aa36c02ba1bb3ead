"""The grouped matmul on Hopper and newer: the pinned JAX's Mosaic GPU ragged dot (`ragged_dot_mgpu`: a
persistent kernel whose row tiles each belong to one group, TMA-pipelined WGMMA in float32 accumulators),
for the forward and, with the matrices read transposed, the input gradient. Same contract as grouped_xla.gmm.

It takes 16-bit operands, and widths and row tiles that are multiples of 64 (`refusal`, the interface's hook); other
calls take the Triton kernels. The weights' gradient is the Triton tgmm: JAX's `transposed_ragged_dot_mgpu` sizes its grid from
`jax.devices()[0]`, so it cannot be compiled for a GPU target from a machine without one.
"""

import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

BLOCK_K = 64  # contraction chunk of one pipeline stage
STAGES = 4  # pipeline stages in flight: 4 x (128 x 64 + 64 x 128) bf16 = 128 KiB of the 227 KiB of shared memory


def refusal(dtype, k: int, n: int, options) -> str | None:
  """Why the Mosaic GPU kernel refuses these operands (it takes 16-bit ones, both widths (K, N) and the row tile
  multiples of 64), or None."""
  if jnp.dtype(dtype).itemsize == 2 and all(width % 64 == 0 for width in (k, n, options.group_rows)):
    return None
  return f"Mosaic GPU's grouped matmul takes 16-bit operands whose widths and row tile are multiples of 64, not {jnp.dtype(dtype).name} K={k} N={n} rows {options.group_rows}"


def gmm(lhs_SK, rhs_EKN, group_sizes_E, transpose_rhs, options):
  """[S, N] in lhs's dtype: lhs[s] @ rhs[group(s)] (.T with transpose_rhs), float32 sums; rows after the last
  group are zeros."""
  dtype = lhs_SK.dtype
  n_out = rhs_EKN.shape[1 if transpose_rhs else 2]
  out_SN = ragged_dot_mgpu.ragged_dot(
    lhs_SK,
    rhs_EKN.astype(dtype),
    group_sizes=group_sizes_E.astype(jnp.int32),
    block_m=options.group_rows,
    block_n=128 if n_out % 128 == 0 else 64,
    block_k=BLOCK_K,
    max_concurrent_steps=STAGES,
    grid_block_n=1,
    transpose_rhs=transpose_rhs,
  )
  routed = jnp.arange(lhs_SK.shape[0], dtype=jnp.int32)[:, None] < jnp.sum(group_sizes_E)
  return jnp.where(routed, out_SN, jnp.zeros((), dtype))  # the kernel writes only the groups' rows

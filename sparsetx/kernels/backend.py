"""The row-kernel interface every accelerator backend of the sparse layers implements, stated once.

Three kernels do all of a sparse layer's table work (the gated gather's forward and backward, FFF's walk levels,
the d-split's partial dots, the table gradients); the per-slot arithmetic between them is XLA's. A backend is a
module with these three functions (mosaic_gpu, pallas_gpu for Triton, pallas_tpu); platform.kernel_backend picks
it. A kernel works on one device's arrays: it never reads the mesh, and pads its operands to its own tiles.
"""

from typing import Protocol, runtime_checkable

import jax

from sparsetx.kernels.options import KernelOptions


@runtime_checkable
class RowKernels(Protocol):
  """The shape contract (N tokens, S slots, R table rows, D = d_model, P pairs); sums are float32."""

  def row_dots(self, lhs_ND: jax.Array, table_RD: jax.Array, rows_SN: jax.Array, options: KernelOptions) -> jax.Array:
    """dots [S, N] float32: dots[s, t] = <lhs[t], table[rows[s, t]]>, the table's rows rounded to lhs's dtype."""
    ...

  def row_accumulate(
    self, coef_SN: jax.Array, table_RD: jax.Array, rows_SN: jax.Array, out_dtype, options: KernelOptions
  ) -> jax.Array:
    """out [N, D] in out_dtype: out[t] = sum_s coef[s, t] * table[rows[s, t]], summed in float32."""
    ...

  def segment_sums(
    self,
    values_ND: jax.Array,
    tokens_P: jax.Array,
    coefs_P: jax.Array,
    starts_R1: jax.Array,
    options: KernelOptions,
    with_coef_sums: bool = False,
  ) -> tuple:
    """(sums [R, D] float32, coef_sums [R] float32 or None) of pairs sorted by row: row r owns the pairs
    [starts[r], starts[r + 1]); sums[r] = sum_p coefs[p] * values[tokens[p]], summed in pair order (no atomics:
    deterministic), each row written once; coef_sums[r] = sum_p coefs[p]."""
    ...

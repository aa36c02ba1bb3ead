"""The row-kernel interface, stated once: what the gated gather asks of an implementation (RowKernels), and what a
module of row kernels provides (MODULE_HOOKS: the three kernels every module has, and each optional hook with what
its absence means).

Three kernels do all of a sparse layer's table work (row_dots, row_accumulate, segment_sums); the composed forms
over them (the gated gather's forward and backward, the tables' sums of sorted pairs, FFF's walk) compose them
unless the module fuses a form itself (XLA's token-chunked scans). rows/records.py makes a module, and the designs
composed onto it, into an implementation; rows/table.py lists them.

More: docs/modules.md, sparsetx/kernels/rows/interface.py.
"""

import jax

from sparsetx.kernels.device import TracedDevice
from sparsetx.kernels.options import KernelOptions


class RowKernels:
  """The shape contract (N tokens, S slots, R table rows, D = d_model, P pairs); sums are float32."""

  name = ""
  platform = None  # where it runs natively (None: everywhere, XLA's)
  cpu_row_sorted = False  # offers the CPU's one walk of the gated gather in row order (xla_gather.row_sorted_*)

  def refuse(self, device: TracedDevice, options: KernelOptions, call=None) -> None:
    """Raises NotImplementedError with the reason where this implementation cannot take this call on `device`."""

  def row_dots(self, lhs_ND: jax.Array, table_RD: jax.Array, rows_SN: jax.Array, options: KernelOptions) -> jax.Array:
    """dots [S, N] float32: dots[s, t] = <lhs[t], table[rows[s, t]]>, the table's rows rounded to lhs's dtype."""
    raise NotImplementedError

  def row_accumulate(
    self, coef_SN: jax.Array, table_RD: jax.Array, rows_SN: jax.Array, out_dtype, options: KernelOptions
  ) -> jax.Array:
    """out [N, D] in out_dtype: out[t] = sum_s coef[s, t] * table[rows[s, t]], summed in float32."""
    raise NotImplementedError

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
    raise NotImplementedError

  def forward(self, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options):
    """y [N, D] (x's dtype) and the pre-activations h [N, S] (float32)."""
    raise NotImplementedError

  def forward_from_pre_activation(self, x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options):
    """y [N, D] from given pre-activations h [N, S]."""
    raise NotImplementedError

  def backward_rows(self, dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options):
    """dx [N, D], dgates, coef_in = dL/dh and coef_out = a(h, gate) ([N, S] float32)."""
    raise NotImplementedError

  def table_sums(self, x_ND, dy_ND, pairs, n_rows, options, with_bias):
    """(dW_in, dW_out, dbias or None) float32 from the pairs sorted by row (segment_grads.SortedPairs)."""
    raise NotImplementedError

  def walk(self, options, x_ND, w_in_PMD, b_in_PM, node_NP, n_levels, rows_per_chunk):
    """FFF's walk down n_levels levels from node_NP: nodes and logits [N, P, n_levels]."""
    raise NotImplementedError

  def __repr__(self) -> str:
    return f"<row kernels {self.name}>"


KERNELS = ("row_dots", "row_accumulate", "segment_sums")  # every module's, with RowKernels' signatures (less self)


def _fits(*_, **__) -> bool:
  return True


# A module's optional hooks, each with what its absence means (None: the record composes the form from the kernels).
MODULE_HOOKS = {
  # the designs' kernels (records.Rows(row_order=True | fused=True) need them)
  "row_order_dots": None,  # (lhs_ND, table_RD, tokens_P, rows_P, starts_R1, options) -> dots [P] of row-sorted pairs
  "fused_forward": None,  # forward's signature: the dots, the gating and the row sum in one kernel
  # whether a call fits the designs' buffers (n_tokens or n_slots, d_model, itemsize, interpret) and whether the
  # fused kernel lowers an activation (gating): absent, everything fits
  "row_order_fits": _fits,
  "fused_fits": _fits,
  "fused_gating": _fits,
  # the module's own fused forms, in place of the compositions of its kernels (XLA's scans)
  "forward_from_pre_activation": None,
  "backward_rows": None,
  "table_sums": None,
  "walk": None,
}


def hook(module, name: str):
  """`module`'s hook `name`, or the interface's default for it (a name MODULE_HOOKS does not declare is an error)."""
  if name not in MODULE_HOOKS:
    raise AttributeError(f"{name!r} is no hook of the row-kernel interface; declare it in MODULE_HOOKS.")
  return getattr(module, name, MODULE_HOOKS[name])

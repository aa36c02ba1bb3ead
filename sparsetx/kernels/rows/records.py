"""An implementation of the row op as one record: a module of row kernels (rows/interface.py) on its platform, with
the designs composed onto it as fields, not subclasses. `row_order` walks the per-pair dots in row order (the
module's row_order_dots), `fused` runs the forward as one kernel (its fused_forward), `tiling` sets kernel knobs on
every call; they combine freely, so a fused row-order design is one line in rows/table.py.

Each composed form takes the module's own fused form where it has one (XLA's scans), except where a design replaces
a kernel that form would bypass (row-order dots compose the backward and the walk from the row-sorted dots).

More: docs/modules.md, sparsetx/kernels/rows/records.py.
"""

import dataclasses
import types

import jax.numpy as jnp

from sparsetx.kernels.fff import tree_walk
from sparsetx.kernels.platform import OnPlatform
from sparsetx.kernels.rows import row_gather, segment_grads
from sparsetx.kernels.rows.interface import RowKernels, hook

TILING_KNOBS = ("block_tokens", "block_d", "stages")  # the KernelOptions fields a tiling sets


@dataclasses.dataclass(frozen=True, eq=False)
class Rows(OnPlatform, RowKernels):
  """`module`'s row kernels, with the designs this record composes onto them."""

  module: types.ModuleType | None = None
  row_order: bool = False  # the per-pair dots walked with the pairs sorted by row (module.row_order_dots)
  fused: bool = False  # the gated gather's forward as one kernel (module.fused_forward)
  tiling: tuple = ()  # ((knob, value), ...) every call's options take
  cpu_row_sorted: bool = False  # offers the CPU's one walk of the gated gather in row order (xla_gather.row_sorted_*)

  @property
  def base(self) -> str:
    """The registry name without the tiling (what kernel.implementation names)."""
    return self.name.partition("@")[0]

  def at_tiling(self, knobs: dict) -> "Rows":
    """This record at a tiling (`triton@block_tokens=16,block_d=256`): what the autotuner measures beside the
    config's knobs, and what `auto` runs where the table ranks it first."""
    unknown = set(knobs) - set(TILING_KNOBS)
    if unknown:
      raise ValueError(f"a tiling sets {TILING_KNOBS}, not {sorted(unknown)}.")
    tiling = tuple(sorted(knobs.items()))
    return dataclasses.replace(self, name=f"{self.base}@" + ",".join(f"{k}={v}" for k, v in tiling), tiling=tiling)

  def tiled(self, options):
    return options._replace(**dict(self.tiling)) if self.tiling else options

  def _hook(self, name):
    return hook(self.module, name)

  def refuse(self, device, options, call=None):
    super().refuse(device, options, call)
    if not call:
      return
    interpret, itemsize = device.platform != self.platform, jnp.dtype(call["dtype"]).itemsize
    if self.row_order and not self._hook("row_order_fits")(call["tokens"], call["d_model"], itemsize, interpret):
      raise NotImplementedError(f"{call['tokens']} tokens of {call['d_model']} columns do not fit its buffers")
    gather = call.get("form", "gather") == "gather"
    if self.fused and gather and not self._hook("fused_fits")(call["slots"], call["d_model"], itemsize, interpret):
      raise NotImplementedError(f"{call['slots']} slots of whole {call['d_model']}-wide rows do not fit its buffers")

  # The three kernels (row_dots in row order under that design).

  def row_dots(self, lhs_ND, table_RD, rows_SN, options):
    options = self.tiled(options)
    if not self.row_order:
      return self.module.row_dots(lhs_ND, table_RD, rows_SN, options)
    n_slots, n_tokens = rows_SN.shape
    n_rows = table_RD.shape[0]
    order_P, sorted_rows_P = segment_grads.sort_pairs(rows_SN.reshape(-1), n_rows)
    starts_R1 = segment_grads.row_starts(sorted_rows_P, n_rows)
    dots_P = self.module.row_order_dots(lhs_ND, table_RD, order_P % n_tokens, sorted_rows_P, starts_R1, options)
    dots = jnp.zeros((n_slots * n_tokens,), jnp.float32).at[order_P].set(dots_P, unique_indices=True)
    return dots.reshape(n_slots, n_tokens)

  def row_accumulate(self, coef_SN, table_RD, rows_SN, out_dtype, options):
    return self.module.row_accumulate(coef_SN, table_RD, rows_SN, out_dtype, self.tiled(options))

  def segment_sums(self, values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums=False):
    return self.module.segment_sums(values_ND, tokens_P, coefs_P, starts_R1, self.tiled(options), with_coef_sums)

  # The composed forms: the module's fused form where it has one and no design bypasses it, else the kernels.

  def forward(self, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options):
    options = self.tiled(options)
    if self.fused and self._hook("fused_gating")(gating):  # else its kernel cannot lower this activation
      return self.module.fused_forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options)
    return row_gather.forward(self, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options)

  def forward_from_pre_activation(self, x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options):
    options = self.tiled(options)
    own = self._hook("forward_from_pre_activation")
    if own:
      return own(x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options)
    return row_gather.forward_from_pre_activation(self, x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options)

  def backward_rows(self, dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options):
    options = self.tiled(options)
    own = None if self.row_order else self._hook("backward_rows")  # row-order dots: compose from them
    if own:
      return own(dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options)
    return row_gather.backward_rows(self, dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options)

  def table_sums(self, x_ND, dy_ND, pairs, n_rows, options, with_bias):
    own = self._hook("table_sums")
    if own:
      return own(x_ND, dy_ND, pairs, n_rows, self.tiled(options), with_bias)
    return segment_grads.kernel_table_sums(self, x_ND, dy_ND, pairs, n_rows, self.tiled(options), with_bias)

  def walk(self, options, x_ND, w_in_PMD, b_in_PM, node_NP, n_levels, rows_per_chunk):
    own = None if self.row_order else self._hook("walk")
    if own:
      return own(x_ND, w_in_PMD, b_in_PM, node_NP, n_levels, rows_per_chunk)
    # one row_dots launch per level takes every token
    return tree_walk.with_row_dots(self, self.tiled(options), x_ND, w_in_PMD, b_in_PM, node_NP, n_levels)

  def __repr__(self) -> str:
    return f"<row kernels {self.name}>"

"""The row-kernel interface every implementation of the sparse layers' table work provides, stated once.

Three kernels do all of a sparse layer's table work (row_dots, row_accumulate, segment_sums); the composed forms
over them (the gated gather's forward and backward, the tables' sums of sorted pairs, FFF's walk) compose them by
default, and an implementation may fuse them instead (XLA's token-chunked scans). XLA is an implementation like
the others; kernels/registry.py lists them in order, and a new one is its file and one line there.
"""

import importlib

import jax
import jax.numpy as jnp

from sparsetx.kernels import row_gather, segment_grads, tree_walk, xla_gather
from sparsetx.kernels.device import TracedDevice
from sparsetx.kernels.options import KernelOptions


class RowKernels:
  """The shape contract (N tokens, S slots, R table rows, D = d_model, P pairs); sums are float32."""

  name = ""
  platform = None  # where it runs natively (None: everywhere, XLA's)
  row_order = False  # offers the CPU's one walk of the gated gather in row order (xla_gather.row_sorted_*)

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

  # The composed forms: compositions of the three kernels unless an implementation fuses them.

  def forward(self, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options):
    """y [N, D] (x's dtype) and the pre-activations h [N, S] (float32)."""
    return row_gather.forward(self, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options)

  def forward_from_pre_activation(self, x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options):
    return row_gather.forward_from_pre_activation(self, x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options)

  def backward_rows(self, dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options):
    """dx [N, D], dgates, coef_in = dL/dh and coef_out = a(h, gate) ([N, S] float32)."""
    return row_gather.backward_rows(self, dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options)

  def table_sums(self, x_ND, dy_ND, pairs, n_rows, options, with_bias):
    """(dW_in, dW_out, dbias or None) float32 from the pairs sorted by row (segment_grads.SortedPairs)."""
    return segment_grads.kernel_table_sums(self, x_ND, dy_ND, pairs, n_rows, options, with_bias)

  def walk(self, options, x_ND, w_in_PMD, b_in_PM, node_NP, n_levels, rows_per_chunk):
    """FFF's walk down n_levels levels from node_NP: nodes and logits [N, P, n_levels]."""
    del rows_per_chunk  # one row_dots launch per level takes every token
    return tree_walk.with_row_dots(self, options, x_ND, w_in_PMD, b_in_PM, node_NP, n_levels)

  def __repr__(self) -> str:
    return f"<row kernels {self.name}>"


TILING_KNOBS = ("block_tokens", "block_d", "stages")  # the KernelOptions fields a tiling sets


class Tiled(RowKernels):
  """An implementation at one tiling (`triton@block_tokens=16,block_d=256`): every call's options take the tiling's
  knobs, so its kernels and the forms composed from them run at it. What the autotuner measures beside the
  implementation's config tiling, and what `auto` runs where the table ranks it first."""

  def __init__(self, base: RowKernels, tiling: dict):
    unknown = set(tiling) - set(TILING_KNOBS)
    if unknown:
      raise ValueError(f"a tiling sets {TILING_KNOBS}, not {sorted(unknown)}.")
    self.base, self.tiling = base, dict(tiling)
    self.name = f"{base.name}@" + ",".join(f"{knob}={value}" for knob, value in sorted(self.tiling.items()))
    self.platform, self.row_order = base.platform, base.row_order

  def tiled(self, options):
    return options._replace(**self.tiling)

  def refuse(self, device, options, call=None):
    self.base.refuse(device, self.tiled(options), call)

  def row_dots(self, lhs_ND, table_RD, rows_SN, options):
    return self.base.row_dots(lhs_ND, table_RD, rows_SN, self.tiled(options))

  def row_accumulate(self, coef_SN, table_RD, rows_SN, out_dtype, options):
    return self.base.row_accumulate(coef_SN, table_RD, rows_SN, out_dtype, self.tiled(options))

  def segment_sums(self, values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums=False):
    return self.base.segment_sums(values_ND, tokens_P, coefs_P, starts_R1, self.tiled(options), with_coef_sums)

  def forward(self, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options):
    return self.base.forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, self.tiled(options))

  def forward_from_pre_activation(self, x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options):
    tiled = self.tiled(options)
    return self.base.forward_from_pre_activation(x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, tiled)

  def backward_rows(self, dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options):
    tiled = self.tiled(options)
    return self.base.backward_rows(dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, tiled)

  def table_sums(self, x_ND, dy_ND, pairs, n_rows, options, with_bias):
    return self.base.table_sums(x_ND, dy_ND, pairs, n_rows, self.tiled(options), with_bias)

  def walk(self, options, x_ND, w_in_PMD, b_in_PM, node_NP, n_levels, rows_per_chunk):
    return self.base.walk(self.tiled(options), x_ND, w_in_PMD, b_in_PM, node_NP, n_levels, rows_per_chunk)


class OnPlatform:
  """Where a kernel family runs: natively on `platform` (with what `needs` asks of the device; None: XLA's, every
  platform), refused on the accelerators in `refused_on`, and elsewhere (a CPU) in interpret mode when named (the
  registry tries an implementation off its platform only then). `interprets_by_default`: the families whose
  interpreter is fast enough for the CPU's checks of every kernel (Triton's generic one; Mosaic GPU's simulation of
  TMA and barriers is not), registry.runs_here(interpreted=True)."""

  def __init__(self, name, platform, needs=None, refused_on=(), interprets_by_default=False, tilings=()):
    self.name, self.platform, self.needs = name, platform, needs
    self.refused_on, self.interprets_by_default = refused_on, interprets_by_default
    self.tilings = tuple(tilings)  # the tilings the autotuner may measure beside the config's (Tiled)

  def refuse(self, device, options, call=None):
    del options, call
    if self.platform is None:
      return
    if device.platform in self.refused_on:
      raise NotImplementedError(f"it runs on {self.platform.upper()}s, not on a {device.platform.upper()}")
    if device.platform == self.platform and self.needs and not self.needs[0](device):
      raise NotImplementedError(f"it needs {self.needs[1]}; {device.device_kind} is not one")


class ModuleRows(OnPlatform, RowKernels):
  """An implementation whose kernels are a module's functions (pallas_gpu, mosaic_gpu, pallas_tpu, xla_rows),
  imported on first use: the three row kernels, and the designs' own where a subclass asks for them."""

  def __init__(self, name: str, module: str, platform: str | None, **where):
    super().__init__(name, platform, **where)
    self.module_name = module

  @property
  def module(self):
    return importlib.import_module(self.module_name)

  def row_dots(self, lhs_ND, table_RD, rows_SN, options):
    return self.module.row_dots(lhs_ND, table_RD, rows_SN, options)

  def row_accumulate(self, coef_SN, table_RD, rows_SN, out_dtype, options):
    return self.module.row_accumulate(coef_SN, table_RD, rows_SN, out_dtype, options)

  def segment_sums(self, values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums=False):
    return self.module.segment_sums(values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums)


def _itemsize(call) -> int:
  return jnp.dtype(call["dtype"]).itemsize


class RowOrderDots(ModuleRows):
  """A module's kernels with the per-pair dots walked in row order (its `row_order_dots`): the pairs sorted by row,
  so each picked row is read once per pass and the tokens' rows come from L2, where token order reads every pick.
  One method: the forward's x . w_in, the backward's dy . w_out, FFF's walk and the d-split's partial dots all
  take it. Each pass sorts its pairs (the table gradients sort once more). Where the module has `row_order_fits`
  (its tokens held in a fixed budget), a call whose tokens do not fit is refused."""

  def refuse(self, device, options, call=None):
    super().refuse(device, options, call)
    fits = getattr(self.module, "row_order_fits", None)
    if fits and call and not fits(call["tokens"], call["d_model"], _itemsize(call), device.platform != self.platform):
      raise NotImplementedError(f"{call['tokens']} tokens of {call['d_model']} columns do not fit its buffers")

  def row_dots(self, lhs_ND, table_RD, rows_SN, options):
    n_slots, n_tokens = rows_SN.shape
    n_rows = table_RD.shape[0]
    order_P, sorted_rows_P = segment_grads.sort_pairs(rows_SN.reshape(-1), n_rows)
    starts_R1 = segment_grads.row_starts(sorted_rows_P, n_rows)
    dots_P = self.module.row_order_dots(lhs_ND, table_RD, order_P % n_tokens, sorted_rows_P, starts_R1, options)
    dots = jnp.zeros((n_slots * n_tokens,), jnp.float32).at[order_P].set(dots_P, unique_indices=True)
    return dots.reshape(n_slots, n_tokens)


class FusedForward(ModuleRows):
  """A module's kernels with the gated gather's forward as one kernel (its `fused_forward`): per block of tokens
  the dots with w_in's rows, the gating and the sum of w_out's rows, so the pre-activations and coefficients
  never make a round trip through HBM and both tables' rows of a token are read by one program. One method (and,
  where the module has them, `fused_fits`: whether whole rows fit its buffers, else the call is refused; and
  `fused_gating`: whether its kernel lowers the activation, else the forward is composed from its row kernels)."""

  def refuse(self, device, options, call=None):
    super().refuse(device, options, call)
    fits = getattr(self.module, "fused_fits", None)
    if (
      fits
      and call
      and call.get("form", "gather") == "gather"
      and not fits(call["slots"], call["d_model"], _itemsize(call), device.platform != self.platform)
    ):
      raise NotImplementedError(f"{call['slots']} slots of whole {call['d_model']}-wide rows do not fit its buffers")

  def forward(self, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options):
    takes = getattr(self.module, "fused_gating", None)
    if takes and not takes(gating):  # its kernel cannot lower this activation: the composed forward
      return super().forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options)
    return self.module.fused_forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options)


class XlaRows(FusedForward):
  """XLA's ops (xla_rows.py), each form fused by XLA over token chunks (xla_gather.py): the forward's gather, dots,
  gating and sum in one chunked pass, the backward's likewise; the tables' sums as sorted scatter-adds, and on a
  CPU the gated gather's one walk in row order. Runs everywhere; on a GPU or TPU one chunk holds every token
  (platform.cpu_chunk), so no cache-sized loop reaches the device."""

  row_order = True

  def __init__(self, name: str = "xla"):
    super().__init__(name, "sparsetx.kernels.xla_rows", None)

  def forward_from_pre_activation(self, x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options):
    return xla_gather.forward_from_pre_activation(x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options)

  def backward_rows(self, dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options):
    return xla_gather.backward_rows(dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options)

  def table_sums(self, x_ND, dy_ND, pairs, n_rows, options, with_bias):
    return segment_grads.scan_table_sums(x_ND, dy_ND, pairs, n_rows, options, with_bias)

  def walk(self, options, x_ND, w_in_PMD, b_in_PM, node_NP, n_levels, rows_per_chunk):
    return tree_walk.gathered(x_ND, w_in_PMD, b_in_PM, node_NP, n_levels, rows_per_chunk)

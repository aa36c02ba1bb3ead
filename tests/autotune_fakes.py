"""Row-kernel and grouped-matmul implementations the autotune tests measure (named `autotune_fakes:NAME`): XLA's
own, but one refuses, one kills its process as a faulting kernel would, some are off (1% in the outputs, in x's
gradient, on hot rows' cut pieces, in the d-split's partial dots; float32 table gradients rounded to bf16), one is
slow (it sleeps), one hangs, one raises, one exits non-zero after answering, two report their environment, one is
plain, and a grouped matmul ignores group_sizes."""

import atexit
import os
import signal
import time
import types

import jax
import jax.numpy as jnp

from sparsetx.kernels.grouped_matmul import xla as grouped_xla
from sparsetx.kernels.grouped_matmul.interface import GroupedKernels
from sparsetx.kernels.rows import xla
from sparsetx.kernels.rows.records import Rows


def xla_rows(cls, name):
  """XLA's record as `cls`, without the CPU's row-order walk (their token-order forms run)."""
  return cls(name, None, module=xla, fused=True)


class Refuses(Rows):
  def refuse(self, device, options, call=None):
    raise NotImplementedError("it needs a Hopper GPU (a test implementation)")


class Faults(Rows):
  def forward(self, *args):
    os.kill(os.getpid(), signal.SIGILL)  # an illegal instruction in a kernel ends the process


class Wrong(Rows):
  def forward(self, *args):
    y_ND, h_NS = super().forward(*args)
    return y_ND * 1.01, h_NS


class Slow(Rows):
  """XLA's values, after a host callback that sleeps 50 ms on every forward: slower by construction."""

  def forward(self, *args):
    y_ND, h_NS = super().forward(*args)
    return jax.pure_callback(_after_a_nap, jax.ShapeDtypeStruct(y_ND.shape, y_ND.dtype), y_ND), h_NS


def _after_a_nap(y):
  time.sleep(0.05)
  return y


REFUSES, FAULTS, WRONG, SLOW = (
  xla_rows(c, n) for c, n in ((Refuses, "refuses"), (Faults, "faults"), (Wrong, "wrong"), (Slow, "slow"))
)
FAST = xla_rows(Rows, "fast")


class WrongGradients(Rows):
  """XLA's outputs, but x's gradient 1% off: only a check of the backward catches it."""

  def backward_rows(self, *args):
    dx_ND, *rest = super().backward_rows(*args)
    return (dx_ND * 1.01, *rest)


class Hangs(Rows):
  """Answers only after 120 s: a child past the autotuner's time limit."""

  def refuse(self, device, options, call=None):
    time.sleep(120)


class ReportsEnvironment(Rows):
  """Refuses with the preallocation setting its process inherited: what the spawning process had at spawn time."""

  def refuse(self, device, options, call=None):
    raise NotImplementedError(f"XLA_PYTHON_CLIENT_PREALLOCATE={os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')}")


WRONG_GRADIENTS, HANGS, REPORTS_ENVIRONMENT = (
  xla_rows(WrongGradients, "wrong_gradients"),
  xla_rows(Hangs, "hangs"),
  xla_rows(ReportsEnvironment, "env"),
)


class Raises(Rows):
  """A kernel whose lowering fails (a Mosaic or Triton compile error): in a child a traceback, in-process caught."""

  def forward(self, *args):
    raise RuntimeError("the kernel failed to compile (a test implementation)")


class ExitsAfterAnswering(Rows):
  """Right values, then its process exits with code 7 after printing its result (a context torn down in error)."""

  def refuse(self, device, options, call=None):
    atexit.register(os._exit, 7)


class ReportsCache(Rows):
  """Refuses with the compilation cache directory its process inherited."""

  def refuse(self, device, options, call=None):
    raise NotImplementedError(f"JAX_COMPILATION_CACHE_DIR={os.environ.get('JAX_COMPILATION_CACHE_DIR')}")


class WrongSlices(Rows):
  """XLA's fused forms (right on whole rows), but its row_dots kernel, which only the d-split composes, 1% off."""

  def row_dots(self, *args):
    return super().row_dots(*args) * 1.01


class RoundsTableSums(Rows):
  """The table gradients rounded to bf16 (a kernel that sums or stores them in bf16): within a bf16 step's slack,
  not within float32's."""

  def table_sums(self, *args):
    return tuple(None if a is None else a.astype(jnp.bfloat16).astype(a.dtype) for a in super().table_sums(*args))


RAISES, EXITS_AFTER_ANSWERING, REPORTS_CACHE, WRONG_SLICES, ROUNDS_TABLE_SUMS = (
  xla_rows(c, n)
  for c, n in (
    (Raises, "raises"),
    (ExitsAfterAnswering, "exits"),
    (ReportsCache, "cache"),
    (WrongSlices, "slices"),
    (RoundsTableSums, "rounds"),
  )
)


def _full_chunks_off(values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums=False):
  """XLA's segment sums, 1% off on segments of exactly segment_chunk pairs: the cut pieces of a hot row."""
  sums_RD, coef_sums_R = xla.segment_sums(values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums)
  full_R = (starts_R1[1:] - starts_R1[:-1]) == options.segment_chunk
  return sums_RD * jnp.where(full_R, 1.01, 1.0)[:, None], coef_sums_R


# The kernels composed (no fused forms), so the table gradients run the hot-row cut and combine (row_chunks.py).
HOT_ROWS_WRONG = Rows(
  "hot_rows_wrong",
  None,
  module=types.SimpleNamespace(row_dots=xla.row_dots, row_accumulate=xla.row_accumulate, segment_sums=_full_chunks_off),
)


def _equal_groups(group_sizes_E, n_rows):
  return jnp.full(group_sizes_E.shape, n_rows // group_sizes_E.shape[0], jnp.int32)


def _gmm_equal(lhs_SK, rhs_EKN, group_sizes_E, transpose_rhs, options):
  return grouped_xla.gmm(lhs_SK, rhs_EKN, _equal_groups(group_sizes_E, lhs_SK.shape[0]), transpose_rhs, options)


def _tgmm_equal(lhs_SK, dout_SN, group_sizes_E, options):
  return grouped_xla.tgmm(lhs_SK, dout_SN, _equal_groups(group_sizes_E, lhs_SK.shape[0]), options)


# A grouped matmul that splits the rows equally among the groups, whatever group_sizes says: right only on equal,
# full groups.
IGNORES_GROUP_SIZES = GroupedKernels(
  "ignores_sizes", None, module=types.SimpleNamespace(gmm=_gmm_equal, tgmm=_tgmm_equal)
)

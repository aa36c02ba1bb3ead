"""What an implementation of the grouped matmul is: a (gmm, tgmm) pair of kernels the op runs under its custom VJP
(grouped_matmul/op.py), a module's gmm and a tgmm of its own or another module's (GroupedKernels), or XLA's
(GroupedXla); and the one optional hook a kernel module may have, `refusal(dtype, k, n, options) -> str | None`
(absent: it takes every call). grouped_matmul/table.py lists them.

More: docs/modules.md, sparsetx/kernels/grouped_matmul/interface.py.
"""

import dataclasses
import types

from sparsetx.kernels import platform
from sparsetx.kernels.grouped_matmul import xla


def _takes_every_call(dtype, k, n, options) -> None:
  del dtype, k, n, options


MODULE_HOOKS = {"refusal": _takes_every_call}  # the reason a module refuses these operands, or None


@dataclasses.dataclass(frozen=True, eq=False)
class GroupedKernels(platform.OnPlatform):
  """A (gmm, tgmm) pair: `module`'s gmm, and tgmm from `tgmm_module` (default the same module), under one VJP."""

  module: types.ModuleType | None = None
  tgmm_module: types.ModuleType | None = None

  def refuse(self, device, options, call=None):
    super().refuse(device, options, call)
    refusal = getattr(self.module, "refusal", MODULE_HOOKS["refusal"])
    why = None if call is None else refusal(call["dtype"], call["k"], call["n"], options)
    if why:
      raise NotImplementedError(why)

  def kernels(self, options) -> tuple:
    """(gmm, tgmm)."""
    del options
    return self.module.gmm, (self.tgmm_module or self.module).tgmm

  def __repr__(self) -> str:
    return f"<grouped matmul {self.name}>"


@dataclasses.dataclass(frozen=True, eq=False)
class GroupedXla(platform.OnPlatform):
  """XLA's: on a CPU the row-tiled gmm and tgmm of xla.py (each expert's live tiles only), elsewhere and for the
  `reference` implementation jax.lax.ragged_dot with its own gradient."""

  def kernels(self, options) -> tuple | None:
    """XLA's row-tiled (gmm, tgmm) on a CPU; None elsewhere (the op's ragged_dot, which XLA differentiates)."""
    return (xla.gmm, xla.tgmm) if platform.on_cpu() and options.implementation != "reference" else None

  def __repr__(self) -> str:
    return "<grouped matmul xla>"

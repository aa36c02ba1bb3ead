"""MoE's grouped matmul as implementations of one op (kernels/registry.py): each a (gmm, tgmm) pair of kernels under
one custom VJP, or XLA's.

  gmm:   out[s]  = lhs[s] @ rhs[g(s)]       (forward; with rhs read transposed, the input gradient)
  tgmm:  drhs[e] = sum_{s in e} outer(lhs[s], dout[s])           (the weights' gradient)
"""

import functools
import importlib

import jax
import jax.numpy as jnp

from sparsetx.kernels.backend import OnPlatform


def ragged_dot(lhs_SK, rhs_EKN, group_sizes_E):
  """The XLA op: jax.lax.ragged_dot with float32 sums, rounded to lhs's dtype."""
  out = jax.lax.ragged_dot(lhs_SK, rhs_EKN.astype(lhs_SK.dtype), group_sizes_E, preferred_element_type=jnp.float32)
  return out.astype(lhs_SK.dtype)


class GroupedKernels(OnPlatform):
  """A (gmm, tgmm) pair: `module`'s gmm, and tgmm from `tgmm_module` (default the same module), under one VJP."""

  def __init__(self, name, module, platform, tgmm_module=None, **where):
    super().__init__(name, platform, **where)
    self.gmm_module, self.tgmm_module = module, tgmm_module or module

  def refuse(self, device, options, call=None):
    super().refuse(device, options, call)
    eligible = getattr(self._module(self.gmm_module), "eligible", None)
    if eligible is not None and call is not None and not eligible(call["dtype"], call["k"], call["n"], options):
      raise NotImplementedError("it takes 16-bit operands whose widths and row tile are multiples of 64")

  @staticmethod
  def _module(name):
    return importlib.import_module(f"sparsetx.kernels.{name}")

  def __call__(self, lhs_SK, rhs_EKN, group_sizes_E, options):
    kernels = (self._module(self.gmm_module).gmm, self._module(self.tgmm_module).tgmm)
    return _grouped(kernels, options, lhs_SK, rhs_EKN, group_sizes_E.astype(jnp.int32))

  def __repr__(self) -> str:
    return f"<grouped matmul {self.name}>"


class GroupedXla:
  """XLA's: on a CPU the row-tiled gmm and tgmm of grouped_xla.py (each expert's live tiles only), elsewhere and for
  the `reference` implementation jax.lax.ragged_dot with its own gradient."""

  name, platform = "xla", None

  def refuse(self, device, options, call=None):
    del device, options, call

  def __call__(self, lhs_SK, rhs_EKN, group_sizes_E, options):
    from sparsetx.kernels import grouped_xla, platform  # noqa: PLC0415 (platform imports this module's callers)

    if platform.on_cpu() and options.implementation != "reference":
      kernels = (grouped_xla.gmm, grouped_xla.tgmm)
      return _grouped(kernels, options, lhs_SK, rhs_EKN, group_sizes_E.astype(jnp.int32))
    return ragged_dot(lhs_SK, rhs_EKN, group_sizes_E)

  def __repr__(self) -> str:
    return "<grouped matmul xla>"


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

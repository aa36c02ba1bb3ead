"""Every module of row kernels implements the row-kernel interface (kernels/rows/interface.py) with its exact signatures, and
pads its own operands: Mosaic GPU's row kernels take a token count that is no multiple of their 64-token block."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsetx.kernels import registry
from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows import mosaic
from sparsetx.kernels.rows.interface import KERNELS, MODULE_HOOKS, RowKernels

MODULES = list(dict.fromkeys(i.module for i in registry.ROWS))


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_each_kernel_module_has_the_row_kernel_interface(module):
  """A module the registry lists (its one line) has the three kernels with the interface's exact signature, and a
  design's kernel (row_order_dots, fused_forward) wherever a record composes that design onto it."""
  for name in KERNELS:
    want = list(inspect.signature(getattr(RowKernels, name)).parameters)[1:]  # without self
    assert list(inspect.signature(getattr(module, name)).parameters) == want, name
  for record in (i for i in registry.ROWS if i.module is module):
    assert not record.row_order or hasattr(module, "row_order_dots"), record
    assert not record.fused or hasattr(module, "fused_forward"), record
  assert set(MODULE_HOOKS) >= {"row_order_dots", "fused_forward", "row_order_fits", "fused_fits", "fused_gating"}


def test_the_registry_lists_each_op_in_one_order_with_xla_last():
  """Each op's table in the order GPU, TPU, platform-free (XLA's designs), XLA itself last: a new line goes in its
  platform's block, and nothing here lists the names."""
  rank = {"gpu": 0, "tpu": 1, None: 2}
  for table in (registry.ROWS, registry.GROUPED):
    assert [rank[i.platform] for i in table] == sorted(rank[i.platform] for i in table), table
    assert table[-1].name == "xla" and len({i.name for i in table}) == len(table), table
  assert {"mosaic", "triton", "tpu", "xla"} <= {i.name for i in registry.GROUPED}


def test_mosaic_row_kernels_pad_their_own_tokens():
  n_tokens, n_slots, n_rows, d_model = 70, 3, 40, 128
  k = jax.random.split(jax.random.key(0), 4)
  lhs = jax.random.normal(k[0], (n_tokens, d_model), jnp.float32)
  table = jax.random.normal(k[1], (n_rows, d_model), jnp.float32)
  rows_SN = jax.random.randint(k[2], (n_slots, n_tokens), 0, n_rows)
  coef_SN = jax.random.normal(k[3], (n_slots, n_tokens), jnp.float32)
  options = KernelOptions("mosaic", interpret=True)
  dots = np.asarray(mosaic.row_dots(lhs, table, rows_SN, options))
  out = np.asarray(mosaic.row_accumulate(coef_SN, table, rows_SN, jnp.float32, options))
  lhs64, table64, rows, coef = (np.asarray(a, np.float64) for a in (lhs, table, rows_SN, coef_SN))
  want_dots = np.einsum("td,std->st", lhs64, table64[rows.astype(int)])
  want_out = np.einsum("st,std->td", coef, table64[rows.astype(int)])
  # float32 sums of 128 products of unit normals: each rounding at most 2**-24 of a partial sum below ~128 * 4
  assert dots.shape == (n_slots, n_tokens) and out.shape == (n_tokens, d_model)
  np.testing.assert_allclose(dots, want_dots, rtol=0, atol=128 * 4 * 128 * 2**-24)
  np.testing.assert_allclose(out, want_out, rtol=0, atol=3 * 4 * 4 * 2**-24 * 16)

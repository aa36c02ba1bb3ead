"""The row-order dots (a record's `row_order` design, rows/records.py, issue 47) of every module the registry lists them for equal
float64 dots of the rounded operands, and the design as a whole equals token-order row_dots' definition.

Bound: a float32 sum of d rounded products is within gamma(d) * sum |terms| of the exact sum (Higham eq. 3.5,
gamma(n) = n u / (1 - n u), u = 2**-24), plus the float64 reference's own gamma_64(d).
"""

import inspect

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sparsetx.kernels import registry
from sparsetx.kernels.device import target
from sparsetx.kernels.options import KernelOptions
from sparsetx.measure import aot

U32, U64 = 2.0**-24, 2.0**-53
DESIGNS = [i for i in registry.ROWS if i.row_order]
OPTIONS = KernelOptions("triton", interpret=True, pair_chunk=8)  # XLA's pairs in chunks of 8 on the CPU


def sum_bound(n, abs_sum):
  gamma = lambda u: n * u / (1 - n * u)  # noqa: E731
  return (gamma(U32) + gamma(U64)) * abs_sum


def rounded(a, dtype):
  return np.asarray(a, np.float32).astype(dtype).astype(np.float64)


def test_the_registry_offers_row_order_dots_for_triton_tpu_and_xla():
  assert {i.name for i in DESIGNS} == {"triton_row_order", "tpu_row_order", "xla_row_order"}


@pytest.mark.parametrize("implementation", DESIGNS, ids=lambda i: i.name)
def test_each_module_has_the_row_order_dots_interface(implementation):
  params = list(inspect.signature(implementation.module.row_order_dots).parameters)
  assert params == ["lhs_ND", "table_RD", "tokens_P", "rows_P", "starts_R1", "options"]


@pytest.mark.parametrize("implementation", DESIGNS, ids=lambda i: i.name)
@pytest.mark.parametrize(
  "n_rows, n, d, dtype, table_dtype, hot",
  [
    (21, 13, 384, np.float32, np.float32, 11),
    (37, 7, 64, ml_dtypes.bfloat16, np.float32, 11),
    (40, 9, 256, ml_dtypes.bfloat16, ml_dtypes.bfloat16, 300),  # a row's 300 pairs across three TPU steps
  ],
)
def test_row_order_dots_match_the_float64_dots(implementation, n_rows, n, d, dtype, table_dtype, hot):
  """Each pair's dot, walked by row (Triton: 16-row tiles; TPU: steps of 128 pairs, each distinct row copied once;
  XLA: chunks of 8 pairs): empty rows, one hot row of `hot` pairs beside short ones."""
  rng = np.random.default_rng(n_rows * d + 2)
  lengths = rng.integers(0, 4, n_rows)
  lengths[[0, 6, n_rows - 1]] = 0
  lengths[5] = hot
  starts_R1 = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  rows_P = np.repeat(np.arange(n_rows), lengths).astype(np.int32)
  tokens_P = rng.integers(0, n, rows_P.shape[0]).astype(np.int32)
  lhs_ND = rng.normal(size=(n, d)).astype(dtype)
  table_RD = rng.normal(size=(n_rows, d)).astype(table_dtype)
  args = (lhs_ND, table_RD, tokens_P, rows_P, starts_R1)
  dots_P = implementation.module.row_order_dots(*map(jnp.asarray, args), OPTIONS)
  assert dots_P.shape == tokens_P.shape and dots_P.dtype == jnp.float32
  terms_PD = lhs_ND[tokens_P].astype(np.float64) * rounded(table_RD, dtype)[rows_P]  # table rounded to lhs's dtype
  excess = np.abs(np.asarray(dots_P, np.float64) - terms_PD.sum(-1)) - sum_bound(d, np.abs(terms_PD).sum(-1))
  assert np.all(excess <= 0), excess.max()


@pytest.mark.parametrize("implementation", DESIGNS, ids=lambda i: i.name)
def test_the_design_gives_each_token_and_slot_its_own_dot(implementation):
  """row_dots' contract in token order (dots[s, t] = <lhs[t], table[rows[s, t]]>) from the walk by row: the sort,
  the starts and the scatter back to (slot, token) place every dot where token order has it; repeated rows
  (6 rows for 5 x 9 picks), a row picked twice by one token."""
  rng = np.random.default_rng(4)
  lhs_ND = rng.normal(size=(9, 32)).astype(np.float32)
  table_RD = rng.normal(size=(6, 32)).astype(np.float32)
  rows_SN = rng.integers(0, 6, (5, 9)).astype(np.int32)
  rows_SN[1, 3] = rows_SN[0, 3]
  dots_SN = implementation.row_dots(jnp.asarray(lhs_ND), jnp.asarray(table_RD), jnp.asarray(rows_SN), OPTIONS)
  terms_SND = lhs_ND.astype(np.float64)[None] * table_RD.astype(np.float64)[rows_SN]
  excess = np.abs(np.asarray(dots_SN, np.float64) - terms_SND.sum(-1)) - sum_bound(32, np.abs(terms_SND).sum(-1))
  assert np.all(excess <= 0), excess.max()


def test_the_tpu_row_order_dots_refuse_tokens_beyond_half_of_vmem():
  """Its tokens stay in VMEM: 16,384 tokens of 512 bf16 columns (16 MiB) fit a v5p's 64 MiB; 131,072 do not, and
  the registry passes the call on with the reason."""
  design = registry.by_name("rows", "tpu_row_order")
  with aot.on_topology("v5p:2x2x1"):
    design.refuse(target(), OPTIONS, dict(tokens=16384, d_model=512, slots=128, dtype="bfloat16"))
    with pytest.raises(NotImplementedError, match="131072 tokens of 512 columns do not fit"):
      design.refuse(target(), OPTIONS, dict(tokens=131072, d_model=512, slots=128, dtype="bfloat16"))

"""The fused forward (a record's `fused` design, rows/records.py, issue 47: dots, gating and the sum of w_out's rows in one
kernel per token block) of every module the registry lists it for equals the gated gather's formula in float64
(sgatlin eq. 1-2; reference.py's docstring): h = <x, w_in[row]> + bias[row], a = act(g h) or g act(h) rounded to
x's dtype, y = sum_s a_s w_out[row_s] rounded to x's dtype; both tables' rows rounded to x's dtype.

Bounds from the arithmetic (u32 = 2**-24, u_x = x's unit roundoff): h is a float32 sum of D + 1 terms, within
gamma(D + 1) sum |terms| (Higham eq. 3.5). y is checked from the kernel's own h: a float32 sum of S terms
(gamma(S)) rounded once to x's dtype (u_x |y|), with the coefficients a exact under the identity and within a few
float32 ulps of |g h| (1 + tanh cancels for negative h) plus one rounding to x's dtype under tanh-GELU.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sparsetx.kernels import registry
from sparsetx.kernels.device import target
from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows.gated_gather import gated_gather
from sparsetx.kernels.rows.reference import Gating
from sparsetx.measure import aot
from sparsetx.models.ffn.common import gelu_tanh
from sparsetx.perf import hlo_text

U32, U64 = 2.0**-24, 2.0**-53
UNIT = {np.dtype(np.float32): U32, np.dtype(ml_dtypes.bfloat16): 2.0**-8}
DESIGNS = [i for i in registry.ROWS if i.fused]
OPTIONS = KernelOptions("triton", interpret=True, block_tokens=4, token_chunk=4)


def gamma(n):
  return n * U32 / (1 - n * U32) + n * U64


def gelu64(h):
  return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))


def test_the_registry_offers_a_fused_forward_for_triton_tpu_and_xla():
  assert {i.name for i in DESIGNS} == {"triton_fused", "tpu_fused", "xla"}


# (tokens N, slots S, rows R, d_model D, x dtype, table dtype, gate inside an identity | outside tanh-GELU, bias):
# ragged token blocks, S not a power of two, D of three Triton chunks and of 96 bf16 words padded to 128 (TPU), and
# 260 tokens over two TPU token groups on two interpreted cores.
CASES = [
  (13, 6, 40, 384, np.float32, np.float32, "inside", False),
  (21, 5, 30, 256, ml_dtypes.bfloat16, np.float32, "outside", True),
  (9, 4, 20, 192, ml_dtypes.bfloat16, ml_dtypes.bfloat16, "inside", True),
  (260, 3, 50, 64, np.float32, np.float32, "outside", False),
]


@pytest.mark.parametrize("implementation", DESIGNS, ids=lambda i: i.name)
@pytest.mark.parametrize("n, s, r, d, dtype, table_dtype, gate, with_bias", CASES)
def test_fused_forward_equals_the_float64_formula(implementation, n, s, r, d, dtype, table_dtype, gate, with_bias):
  rng = np.random.default_rng(n * d + s)
  x_ND = rng.normal(size=(n, d)).astype(dtype)
  w_in_RD, w_out_RD = (rng.normal(size=(r, d)).astype(table_dtype) for _ in range(2))
  rows_NS = rng.integers(0, r, (n, s)).astype(np.int32)
  rows_NS[0] = r - 1
  gates_NS = rng.normal(size=(n, s)).astype(np.float32)
  bias_R = rng.normal(size=r).astype(np.float32) if with_bias else None
  gating = Gating() if gate == "inside" else Gating(gelu_tanh, gate_inside=False)

  y_ND, h_NS = implementation.module.fused_forward(
    *map(jnp.asarray, (x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS)),
    None if bias_R is None else jnp.asarray(bias_R),
    gating,
    OPTIONS,
  )
  assert y_ND.shape == (n, d) and y_ND.dtype == dtype and h_NS.shape == (n, s) and h_NS.dtype == jnp.float32

  x64 = x_ND.astype(np.float64)
  w_in64, w_out64 = (np.asarray(w, np.float32).astype(dtype).astype(np.float64) for w in (w_in_RD, w_out_RD))
  terms_NSD = x64[:, None] * w_in64[rows_NS]
  h64 = terms_NSD.sum(-1) + (0 if bias_R is None else bias_R[rows_NS].astype(np.float64))
  h_err = gamma(d + 1) * (np.abs(terms_NSD).sum(-1) + (0 if bias_R is None else np.abs(bias_R[rows_NS])))
  assert np.all(np.abs(np.asarray(h_NS, np.float64) - h64) <= h_err)

  # y from the kernel's own h (checked above): with the identity a = g h is one float32 product rounded to x's
  # dtype, exactly as NumPy rounds it, so y's only slack is its sum; tanh-GELU's float32 evaluation may differ by
  # a few ulps, which the rounding to x's dtype can turn into one ulp of x's dtype.
  h32, g32 = np.asarray(h_NS, np.float32), gates_NS
  if gate == "inside":
    a64 = (g32 * h32).astype(dtype).astype(np.float64)
    a_err = np.zeros_like(a64)
  else:
    a64 = g32.astype(np.float64) * gelu64(h32.astype(np.float64))
    # float32 ulps of 1 + tanh(.) times |g h| / 2 (absolute: 1 + tanh cancels for negative h), then the rounding
    a_err = 16 * U32 * np.abs(g32 * h32) + UNIT[np.dtype(dtype)] * np.abs(a64)
  w_out_NSD = w_out64[rows_NS]
  y64 = np.einsum("ns,nsd->nd", a64, w_out_NSD)
  abs_NSD = np.abs(w_out_NSD)
  y_err = np.einsum("ns,nsd->nd", a_err, abs_NSD) + gamma(s) * np.einsum("ns,nsd->nd", np.abs(a64) + a_err, abs_NSD)
  y_err = y_err + UNIT[np.dtype(dtype)] * (np.abs(y64) + y_err)
  excess = np.abs(np.asarray(y_ND, np.float32).astype(np.float64) - y64) - y_err
  assert np.all(excess <= 0), (excess.max(), np.unravel_index(excess.argmax(), excess.shape))


def test_the_tpu_fused_forward_refuses_rows_wider_than_its_buffers_and_the_next_is_tried():
  """The fused forward holds whole rows (no d chunks): 128 slots of 8,192 bf16 columns exceed a v5p's VMEM slot, so
  the registry passes the call to the next implementation with the reason; 128 slots of 512 fit."""
  fused = registry.by_name("rows", "tpu_fused")
  with aot.on_topology("v5p:2x2x1"):
    device = target()
    fused.refuse(device, KernelOptions("triton"), dict(tokens=4096, d_model=512, slots=128, dtype="bfloat16"))
    with pytest.raises(NotImplementedError, match="128 slots of whole 8192-wide rows do not fit"):
      fused.refuse(device, KernelOptions("triton"), dict(tokens=4096, d_model=8192, slots=128, dtype="bfloat16"))


@pytest.mark.parametrize("approximate", [True, False])
def test_the_tpu_fused_forward_composes_its_row_kernels_where_it_cannot_lower_the_activation(approximate):
  """Pallas TPU lowers no erf: with exact GELU inside the gate the v5p program's forward is tpu_fused's row_dots and
  row_accumulate (compiled by libtpu), with tanh-GELU its one fused kernel."""
  spec = jax.ShapeDtypeStruct
  fused = registry.by_name("rows", "tpu_fused")

  def forward(x, w_in, w_out, rows, gates):
    gelu = lambda h: jax.nn.gelu(h, approximate=approximate)  # noqa: E731
    return gated_gather(x, w_in, w_out, rows, gates, gelu, options=KernelOptions("triton"), implementation=fused)

  table = spec((512, 256), jnp.bfloat16)
  args = (spec((1, 64, 256), jnp.bfloat16), table, table, spec((1, 64, 16), jnp.int32), spec((1, 64, 16), jnp.float32))
  with aot.on_topology("v5p:2x2x1"):
    lowered = jax.jit(forward).trace(*args).lower()
    lowered.compile()
  calls = {name for (target, name) in hlo_text.custom_calls(lowered.as_text()) if target == "tpu_custom_call"}
  composed = {"row_dots", "row_accumulate"}
  assert calls == ({"fused_forward"} if approximate else composed), calls

"""The Pallas gated-gather kernels (GPU and TPU, interpret mode on CPU) equal the XLA path in values and gradients."""

import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import gather_case, mosaic_races_found, value_and_grads

from sparsetx.kernels.rows.gated_gather import KernelOptions, gated_gather
from sparsetx.kernels.rows.reference import Gating
from sparsetx.measure import aot
from sparsetx.models.ffn.common import ACTIVATIONS


def assert_same_loss_and_grads(result, expected, rtol):
  """Loss and each gradient (same dtype; scaled by the expected gradient's largest entry) agree within rtol."""
  (loss, grads), (loss_expected, grads_expected) = result, expected
  np.testing.assert_allclose(loss, loss_expected, rtol=rtol)
  for name, a, b in zip(("x", "w_in", "w_out", "gates", "bias"), grads, grads_expected):
    assert a.dtype == b.dtype, name
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = np.abs(b).max()
    np.testing.assert_allclose(a / scale, b / scale, rtol=rtol, atol=rtol / 4, err_msg=name)


@pytest.mark.parametrize(
  "shape, dtype, activation, with_bias, block_tokens, rtol",
  [
    ((1, 11, 3, 2, 5, 16), jnp.float32, "gelu", True, 4, 2e-5),  # 6 slots padded to 8, ragged token block
    ((2, 8, 2, 3, 4, 8), jnp.bfloat16, "identity", False, 8, 2e-2),
  ],
)
def test_pallas_gpu_kernels_equal_xla_path(shape, dtype, activation, with_bias, block_tokens, rtol):
  x, w_in, w_out, rows, gates, bias = gather_case(4, *shape, dtype=dtype)
  bias = bias if with_bias else None
  act = ACTIVATIONS[activation]
  run = lambda options: value_and_grads(
    lambda *a: gated_gather(*a[:5], act, a[5], options), x, w_in, w_out, rows, gates, bias
  )
  assert_same_loss_and_grads(
    run(KernelOptions("triton", block_tokens=block_tokens, interpret=True)),
    run(KernelOptions("xla", token_chunk=4, pair_chunk=16)),
    rtol,
  )


def test_pallas_tpu_kernels_equal_xla_path_in_interpret_mode():
  """The gated gather's passes composed from the TPU row kernels (row_gather.py) equal the XLA path's."""
  from sparsetx.kernels.rows import row_gather, tpu, xla_gather

  x, w_in, w_out, rows, gates, bias = gather_case(5, 1, 11, 3, 2, 5, 16)
  x, rows, gates = x.reshape(11, 16), rows.reshape(11, 6), gates.reshape(11, 6)
  act = Gating(ACTIVATIONS["gelu"])  # the backends take the op's gating (activation and gate position)
  options = KernelOptions("triton", token_chunk=4, block_tokens=4, interpret=True)
  y_t, h_t = row_gather.forward(tpu, x, w_in, w_out, rows, gates, bias, act, options)
  y_x, h_x = xla_gather.forward(x, w_in, w_out, rows, gates, bias, act, options)
  np.testing.assert_allclose(y_t, y_x, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(h_t, h_x, rtol=1e-5, atol=1e-5)
  dy = jnp.cos(x)
  for name, a, b in zip(
    ("dx", "dgates", "coef_in", "coef_out"),
    row_gather.backward_rows(tpu, dy, h_x, w_in, w_out, rows, gates, act, options),
    xla_gather.backward_rows(dy, h_x, w_in, w_out, rows, gates, act, options),
  ):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize(
  "shape, dtype, activation, with_bias, block_d, stages, rtol",
  [
    # two d_model chunks, ragged token block; swish(g * h): the gate inside a nonlinear activation, as sgatlin
    ((1, 11, 2, 1, 5, 64), jnp.float32, "swish", True, 32, 2, 2e-5),
    ((2, 8, 2, 1, 4, 64), jnp.bfloat16, "identity", False, 64, 3, 2e-2),  # more stages than steps per chunk
  ],
)
def test_mosaic_gpu_kernels_equal_xla_path(shape, dtype, activation, with_bias, block_d, stages, rtol):

  x, w_in, w_out, rows, gates, bias = gather_case(6, *shape, dtype=dtype)
  bias = bias if with_bias else None
  act = ACTIVATIONS[activation]
  run = lambda options: value_and_grads(
    lambda *a: gated_gather(*a[:5], act, a[5], options), x, w_in, w_out, rows, gates, bias
  )
  mosaic_options = KernelOptions("mosaic", block_d=block_d, stages=stages, interpret=True)
  mosaic_result = run(mosaic_options)
  assert not mosaic_races_found()  # in the last kernel (backward dx); each kernel alone: the test below
  assert_same_loss_and_grads(mosaic_result, run(KernelOptions("xla", token_chunk=4, pair_chunk=16)), rtol)


def test_mosaic_gpu_row_kernels_equal_einsum_without_races():
  from sparsetx.kernels.rows import mosaic

  k = jax.random.split(jax.random.key(8), 4)
  lhs, table = jax.random.normal(k[0], (64, 64)), jax.random.normal(k[1], (9, 64))
  rows_SN, coef_SN = jax.random.randint(k[2], (3, 64), 0, 9), jax.random.normal(k[3], (3, 64))
  options = KernelOptions(block_d=32, stages=2, interpret=True)  # 2 chunks x 4 steps through a 2-tile ring
  dots = jax.jit(lambda *a: mosaic.row_dots(*a, options))(lhs, table, rows_SN)
  assert not mosaic_races_found()
  out = jax.jit(lambda *a: mosaic.row_accumulate(*a, jnp.float32, options))(coef_SN, table, rows_SN)
  assert not mosaic_races_found()
  np.testing.assert_allclose(dots, jnp.einsum("nd,snd->sn", lhs, table[rows_SN]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out, jnp.einsum("sn,snd->nd", coef_SN, table[rows_SN]), rtol=1e-5, atol=1e-5)


def test_mosaic_gpu_forward_from_given_pre_activations_equals_xla_path():
  x, w_in, w_out, rows, gates, bias = gather_case(7, 1, 9, 2, 1, 5, 32)
  act = ACTIVATIONS["gelu"]
  h = jnp.einsum("btd,btsd->bts", x, w_in[rows]) + bias[rows]
  y = {
    name: gated_gather(x, w_in, w_out, rows, gates, act, bias, options, pre_activation=h)
    for name, options in [
      ("mosaic", KernelOptions("mosaic", block_d=32, interpret=True)),
      ("xla", KernelOptions("xla")),
    ]
  }
  np.testing.assert_allclose(y["mosaic"], y["xla"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "n_slots, block_d, stages",
  [(128, 128, 3), (300, 64, 2)],  # sgatlin's C*K (defaults); more than one 256-slot box
)
def test_mosaic_gpu_kernels_lower_for_cuda(n_slots, block_d, stages):
  """Lowering for an H100 on CPU runs Mosaic GPU's own checks (register layouts, transfer plans, TMA boxes)."""
  options = KernelOptions("mosaic", block_d=block_d, stages=stages)
  n_tokens, n_rows, d_model = 2048, 4096, 768
  spec = jax.ShapeDtypeStruct
  table, x = spec((n_rows, d_model), jnp.float32), spec((n_tokens, d_model), jnp.bfloat16)
  rows, gates = spec((n_tokens, n_slots), jnp.int32), spec((n_tokens, n_slots), jnp.float32)
  loss = lambda x, w_in, w_out, gates: jnp.sum(gated_gather(x, w_in, w_out, rows_, gates, options=options) ** 2)
  rows_ = jnp.zeros(rows.shape, rows.dtype)
  with aot.on_topology("h100:1x1x1"):
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).trace(x, table, table, gates)
    text = lowered.lower().as_text()
  # row_dots and row_accumulate (forward, backward), and per table segment_sums over the rows' chunks and the combine
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 8


def test_each_device_takes_the_first_implementation_that_accepts_it_in_the_default_order():
  """Without a measured table: Triton rows before Mosaic GPU's (registry.DEFAULT_ORDER), MoE's grouped matmul on
  Mosaic GPU from Hopper on (and only for operands it takes), Triton before Hopper, XLA for `auto` on a CPU; an
  explicit choice stands, and an unknown one is refused."""
  from sparsetx.kernels import registry
  from sparsetx.kernels.device import TracedDevice

  cpu, a100 = TracedDevice("cpu", "cpu", None), TracedDevice("gpu", "NVIDIA A100-SXM4-80GB", 108)
  tpu = TracedDevice("tpu", "TPU v5", 2)
  h200 = TracedDevice("gpu", "NVIDIA H200", 132)
  bf16_64 = dict(dtype="bfloat16", k=64, n=128)

  def chosen(op, options, device, call=None):
    with unittest.mock.patch.object(registry, "target", lambda: device):
      return registry.resolve(op, options, "any", call).name

  assert chosen("rows", KernelOptions(), cpu) == "xla"
  assert chosen("rows", KernelOptions("triton"), cpu) == "triton"  # named: off its GPU, interpreted
  assert chosen("rows", KernelOptions("mosaic,tpu"), cpu) == "xla"  # a list: each on its own platform
  assert chosen("rows", KernelOptions(), h200) == "triton"
  assert chosen("rows", KernelOptions("mosaic"), h200) == "mosaic"
  assert chosen("rows", KernelOptions("mosaic,tpu"), tpu) == "tpu"
  assert chosen("grouped_matmul", KernelOptions("triton_row_order"), h200, bf16_64) == "triton"  # its family's
  assert chosen("grouped_matmul", KernelOptions(), h200, bf16_64) == "mosaic"
  assert chosen("grouped_matmul", KernelOptions(), h200, bf16_64 | {"dtype": "float32"}) == "triton"
  assert chosen("grouped_matmul", KernelOptions(), a100, bf16_64) == "triton"  # before Hopper
  with pytest.raises(NotImplementedError, match="mosaic: it needs a Hopper or newer GPU"):
    chosen("rows", KernelOptions("mosaic"), a100)
  with pytest.raises(ValueError, match="implementation='cuda' is unknown"):
    chosen("rows", KernelOptions("cuda"), a100)


def test_bf16_run_streams_bf16_tables_with_float32_table_gradients():
  """x in bf16, float32 tables: the kernels read the tables as bf16 (one cast per call), the values are exactly
  those of bf16 tables given directly (every backend rounded rows to x's dtype before multiplying anyway), and the
  table gradients come back float32, within bf16 bounds of a float64 reference of the paper's formula.

  Bound (identity activation, so y and each gradient are sums of products of three factors): the table rounding
  (2^-9 relative, u), the slot coefficient's rounding (u), the cotangent's rounding to bf16 (u) and the output's (u)
  give |error| <= 4 u * (the same sum over absolute values), plus float32 summation (negligible at these sizes)."""
  x, w_in, w_out, rows, gates, _ = gather_case(11, 1, 13, 3, 2, 5, 128, dtype=jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(12), x.shape, jnp.float32)
  options = KernelOptions("triton", interpret=True)

  def loss(w_in, w_out):
    return jnp.sum(gated_gather(x, w_in, w_out, rows, gates, options=options).astype(jnp.float32) * dy)

  y32 = gated_gather(x, w_in, w_out, rows, gates, options=options)
  y16 = gated_gather(x, w_in.astype(jnp.bfloat16), w_out.astype(jnp.bfloat16), rows, gates, options=options)
  np.testing.assert_array_equal(np.asarray(y32, np.float32), np.asarray(y16, np.float32))
  dw_in, dw_out = jax.grad(loss, argnums=(0, 1))(w_in, w_out)
  assert dw_in.dtype == dw_out.dtype == jnp.float32

  X, Wi, Wo, G, DY = (np.asarray(a, np.float64) for a in (x[0], w_in, w_out, gates[0], dy[0]))
  r = np.asarray(rows[0])
  t = np.arange(r.shape[0])[:, None].repeat(r.shape[1], 1)

  def reference(X, Wi, Wo, G, DY):
    h = np.einsum("td,tsd->ts", X, Wi[r])
    d_in, d_out = np.zeros_like(Wi), np.zeros_like(Wo)
    np.add.at(d_in, r, (G * np.einsum("td,tsd->ts", DY, Wo[r]))[..., None] * X[t])
    np.add.at(d_out, r, (G * h)[..., None] * DY[t])
    return d_in, d_out

  want, scale = reference(X, Wi, Wo, G, DY), reference(*(np.abs(a) for a in (X, Wi, Wo, G, DY)))
  bound = 4 * 2.0**-9
  for got, w, s in zip((dw_in, dw_out), want, scale):
    assert np.all(np.abs(np.asarray(got, np.float64) - w) <= bound * s + 1e-30)

"""The Pallas gated-gather kernels (GPU and TPU, interpret mode on CPU) equal the XLA path in values and gradients."""

import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import gather_case, value_and_grads

from sparsetx.kernels.gated_gather import KernelOptions, gated_gather
from sparsetx.models.ffn.common import ACTIVATIONS


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
  (loss_p, grads_p) = run(KernelOptions("pallas", block_tokens=block_tokens, interpret=True))
  (loss_x, grads_x) = run(KernelOptions("xla", token_chunk=4, pair_chunk=16))
  np.testing.assert_allclose(loss_p, loss_x, rtol=rtol)
  for name, a, b in zip(("x", "w_in", "w_out", "gates", "bias"), grads_p, grads_x):
    assert a.dtype == b.dtype, name
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = np.abs(b).max()
    np.testing.assert_allclose(a / scale, b / scale, rtol=rtol, atol=rtol / 4, err_msg=name)


def test_pallas_tpu_kernels_equal_xla_path_in_interpret_mode():
  from sparsetx.kernels import pallas_tpu, xla_gather

  x, w_in, w_out, rows, gates, bias = gather_case(5, 1, 11, 3, 2, 5, 16)
  x, rows, gates = x.reshape(11, 16), rows.reshape(11, 6), gates.reshape(11, 6)
  act = ACTIVATIONS["gelu"]
  options = KernelOptions("pallas", token_chunk=4, block_tokens=4, interpret=True)
  y_t, h_t = pallas_tpu.forward(x, w_in, w_out, rows, gates, bias, act, options)
  y_x, h_x = xla_gather.forward(x, w_in, w_out, rows, gates, bias, act, options)
  np.testing.assert_allclose(y_t, y_x, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(h_t, h_x, rtol=1e-5, atol=1e-5)
  dy = jnp.cos(x)
  for name, a, b in zip(
      ("dx", "dgates", "coef_in", "coef_out"),
      pallas_tpu.backward_rows(dy, h_x, w_in, w_out, rows, gates, act, options),
      xla_gather.backward_rows(dy, h_x, w_in, w_out, rows, gates, act, options),
  ):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)

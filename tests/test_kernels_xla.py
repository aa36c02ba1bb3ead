"""The XLA path of the gated gather equals the papers' formulation in values and every gradient."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import gather_case, value_and_grads

from sparsetx import config as config_lib
from sparsetx.kernels.rows.gated_gather import KernelOptions, gated_gather, gated_gather_reference, options_from_config
from sparsetx.models.ffn.common import ACTIVATIONS

NAMES = ("loss", "x", "w_in", "w_out", "gates", "bias")


def assert_match(ours, ref, rtol, atol):
  (loss_a, grads_a), (loss_b, grads_b) = ours, ref
  np.testing.assert_allclose(loss_a, loss_b, rtol=rtol, atol=atol * 10, err_msg="loss")
  for name, a, b in zip(NAMES[1:], grads_a, grads_b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = np.abs(b).max()
    np.testing.assert_allclose(a / scale, b / scale, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize(
  "shape, activation, with_bias, token_chunk, pair_chunk",
  [
    # (no bias, ragged token and pair chunks: test_official_refs.py, against the authors' formulas)
    ((1, 16, 4, 3, 8, 8), "gelu", True, 2, 7),  # pairs not a multiple of the pair chunk
    ((1, 7, 1, 3, 4, 8), "relu", True, 1, 3),
  ],
)
@pytest.mark.parametrize("row_sorted", [False, True])  # token-order walk, or the row-order one (CPU training)
def test_xla_path_equals_reference_float32(shape, activation, with_bias, token_chunk, pair_chunk, row_sorted):
  x, w_in, w_out, rows, gates, bias = gather_case(0, *shape)
  bias = bias if with_bias else None
  act = ACTIVATIONS[activation]
  options = KernelOptions("xla", token_chunk, pair_chunk, row_sorted=row_sorted)
  ours = value_and_grads(lambda *a: gated_gather(*a[:5], act, a[5], options), x, w_in, w_out, rows, gates, bias)
  ref = value_and_grads(lambda *a: gated_gather_reference(*a[:5], act, a[5]), x, w_in, w_out, rows, gates, bias)
  assert_match(ours, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("row_sorted", [False, True])
def test_a_row_picked_twice_by_one_token_counts_twice(row_sorted):
  """The op allows a token to pick one row in two slots (the row-sorted walk merges them): values and
  every gradient still equal the reference."""
  x, w_in, w_out, rows, gates, bias = gather_case(3, 1, 8, 2, 3, 6, 16)
  rows = rows.at[:, :, 1].set(rows[:, :, 0])
  act = ACTIVATIONS["gelu"]
  options = KernelOptions("xla", 4, 16, row_sorted=row_sorted)
  ours = value_and_grads(lambda *a: gated_gather(*a[:5], act, a[5], options), x, w_in, w_out, rows, gates, bias)
  ref = value_and_grads(lambda *a: gated_gather_reference(*a[:5], act, a[5]), x, w_in, w_out, rows, gates, bias)
  assert_match(ours, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("activation", ["swish"])
def test_xla_path_equals_reference_bfloat16(activation):
  x, w_in, w_out, rows, gates, bias = gather_case(1, 2, 12, 3, 2, 6, 32, dtype=jnp.bfloat16)
  act = ACTIVATIONS[activation]
  y = gated_gather(x, w_in, w_out, rows, gates, act, options=KernelOptions("xla", 4, 32))
  y_ref = gated_gather_reference(x, w_in, w_out, rows, gates, act)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), rtol=2e-2, atol=2e-2)
  ours = value_and_grads(
    lambda *a: gated_gather(*a[:5], act, None, KernelOptions("xla", 4, 32)), x, w_in, w_out, rows, gates, None
  )
  ref = value_and_grads(lambda *a: gated_gather_reference(*a[:5], act), x, w_in, w_out, rows, gates, None)
  assert ours[1][0].dtype == jnp.bfloat16 and ours[1][1].dtype == jnp.float32  # dx in x's dtype, tables in theirs
  assert_match(ours, ref, rtol=3e-2, atol=2e-2)


def test_table_gradients_are_deterministic_and_zero_off_the_picked_rows():
  x, w_in, w_out, rows, gates, bias = gather_case(2, 2, 16, 2, 3, 40, 8)
  run = lambda: value_and_grads(
    lambda *a: gated_gather(*a[:5], bias_R=a[5], options=KernelOptions("xla", 4, 8)), x, w_in, w_out, rows, gates, bias
  )
  first, second = run(), run()
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(a, b)
  unpicked = np.setdiff1d(np.arange(w_in.shape[0]), np.asarray(rows))
  assert unpicked.size > 0
  for grad in first[1][1:3]:
    assert np.all(np.asarray(grad)[unpicked] == 0)


def test_no_gathered_rows_tensor_in_the_compiled_step():
  """The fast path never holds a [tokens, S, D] buffer; the papers' formulation does."""
  B, T, C, K, N, D = 1, 64, 4, 4, 32, 16
  x, w_in, w_out, rows, gates, _ = gather_case(3, B, T, C, K, N, D)

  def compiled_text(fn):
    step = jax.jit(jax.grad(lambda x, wi, wo, g: fn(x, wi, wo, rows, g).sum(), argnums=(0, 1, 2, 3)))
    return step.lower(x, w_in, w_out, gates).compile().as_text()

  full = f"f32[{B},{T},{C * K},{D}]"
  ours = compiled_text(functools.partial(gated_gather, options=KernelOptions("xla", 4, 64)))
  assert full not in ours and f"f32[{B * T},{C * K},{D}]" not in ours
  assert full in compiled_text(gated_gather_reference)


def test_options_come_from_the_config_and_bad_values_are_named():
  config = config_lib.default_config()
  config.model.ffn.kernel.update(implementation="xla", token_chunk=2, pair_chunk=64, block_tokens=16)
  assert options_from_config(config.model.ffn.kernel) == KernelOptions("xla", 2, 64, 16)
  config.model.ffn.kernel.implementation = "CUDA!"  # names the registry lacks: at setup (test_config.py)
  with pytest.raises(config_lib.ConfigError, match=r"config.model.ffn.kernel.implementation='CUDA!'"):
    config_lib.validate(config)
  config.model.ffn.kernel.implementation = "auto"
  config.model.ffn.kernel.token_chunk = 0
  with pytest.raises(config_lib.ConfigError, match=r"config.model.ffn.kernel.token_chunk=0"):
    config_lib.validate(config)


def test_given_pre_activations_give_the_same_values_and_gradients():
  """FFF hands the walk's logits in as pre-activations; x, w_in and bias still get their gradients."""
  x, w_in, w_out, rows, gates, bias = gather_case(4, 2, 9, 3, 2, 5, 16)
  act = ACTIVATIONS["gelu"]
  options = KernelOptions("xla", 4, 16)

  def given(x, w_in, w_out, rows, gates, bias):
    h = jnp.einsum("btd,btsd->bts", x, w_in[rows]) + bias[rows]
    return gated_gather(x, w_in, w_out, rows, gates, act, bias, options, pre_activation=jax.lax.stop_gradient(h))

  ours = value_and_grads(given, x, w_in, w_out, rows, gates, bias)
  ref = value_and_grads(lambda *a: gated_gather_reference(*a[:5], act, a[5]), x, w_in, w_out, rows, gates, bias)
  assert_match(ours, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("where", ["cpu", "h100", "v5p"])
def test_each_form_runs_where_its_docstring_says(monkeypatch, where):
  """Row order only where a CPU differentiates a float32 gather: its forward alone, and every accelerator's, run token
  order (the sort does not pay for itself without a backward pass)."""
  from sparsetx.kernels.rows import xla_gather
  from sparsetx.measure import aot

  walked = []
  real = xla_gather.row_sorted_forward
  monkeypatch.setattr(xla_gather, "row_sorted_forward", lambda *a: walked.append(1) or real(*a))
  x, w_in, w_out, rows, gates, _ = gather_case(0, 2, 5, 3, 4, 6, 128)
  forward = lambda x, w_in, w_out, gates: gated_gather(x, w_in, w_out, rows, gates, options=KernelOptions("xla"))  # noqa: E731
  loss = lambda *a: jnp.sum(forward(*a))  # noqa: E731
  ran = {}
  with (
    contextlib.nullcontext() if where == "cpu" else aot.on_topology({"h100": "h100:1x1x4", "v5p": "v5p:2x2x1"}[where])
  ):
    for name, fn in (("primal", forward), ("gradients", jax.grad(loss, argnums=(0, 1, 2, 3)))):
      walked.clear()
      jax.jit(fn).trace(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w_in, w_out, gates)))
      ran[name] = "row sorted" if walked else "token order"
  assert ran == {"primal": "token order", "gradients": "row sorted" if where == "cpu" else "token order"}

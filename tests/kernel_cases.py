"""Shared inputs for the gated-gather kernel tests: random tables, rows with repeats, gates, bias."""

import jax
import jax.numpy as jnp


def gather_case(seed, batch, length, n_channels, top_k, n_neurons, d_model, dtype=jnp.float32):
  """x [B,T,D] in dtype, float32 tables [C*N, D], rows [B,T,C*K] (channel-local, repeats across tokens),
  float32 gates and bias. N is tiny so rows are shared by many tokens (the reuse the fast path exploits)."""
  k = jax.random.split(jax.random.key(seed), 6)
  n_rows = n_channels * n_neurons
  x = jax.random.normal(k[0], (batch, length, d_model), jnp.float32).astype(dtype)
  w_in = jax.random.normal(k[1], (n_rows, d_model)) / d_model**0.5
  w_out = jax.random.normal(k[2], (n_rows, d_model)) / d_model**0.5
  local = jax.random.randint(k[3], (batch, length, n_channels, top_k), 0, n_neurons)
  rows = (local + n_neurons * jnp.arange(n_channels)[None, None, :, None]).reshape(batch, length, n_channels * top_k)
  gates = jax.random.normal(k[4], rows.shape)
  bias = jax.random.normal(k[5], (n_rows,))
  return x, w_in, w_out, rows, gates, bias


def value_and_grads(fn, x, w_in, w_out, rows, gates, bias):
  """A scalar loss that weights every output differently, and its gradients to every float input."""

  def loss(x, w_in, w_out, gates, bias):
    y = fn(x, w_in, w_out, rows, gates, bias).astype(jnp.float32)
    return jnp.sum(jnp.sin(y * 3.0))

  argnums = (0, 1, 2, 3) if bias is None else (0, 1, 2, 3, 4)
  return jax.jit(jax.value_and_grad(loss, argnums=argnums))(x, w_in, w_out, gates, bias)


def mosaic_races_found() -> bool:
  """Whether the last Mosaic GPU kernel run in interpret mode raced on shared memory. JAX keeps the interpreter's
  verdict private (no public accessor in 0.11 or 0.12), so only the tests read it, here."""
  from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races  # noqa: PLC0415

  return get_races().races_found

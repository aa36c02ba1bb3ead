"""Fast XLA path of the gated gather: token-chunked forward and row-side backward.

No [tokens, S, D] tensor of gathered rows ever exists in full: a `lax.scan` walks chunks of
`token_chunk` tokens, gathers only that chunk's rows (small enough to stay in cache), dots, gates
and accumulates in float32. The backward pass re-gathers the rows chunk by chunk to produce dx,
the gate gradients and the per-pair coefficients the table gradients need (segment_grads.py).
Measured on a 2-core CPU, chunks of 4-16 tokens are fastest; larger chunks spill the cache.

Where the time goes (2-core EPYC VM, 16 MiB L3, 2,048 tokens, float32, ladder scale 2: C*K = 128 rows
of 256 values per token and table): the forward gathers 2 * 2048 * 128 rows = 537 MB in ~105 ms,
which is the rate this machine gathers random 1 KiB rows from a table that does not fit in L3
(4.9 GB/s measured with a bare gather-sum, against 12 GB/s streaming and ~10 GB/s from an L3-resident
table). Chunk size, fused multiply-reduce instead of einsum, and in-bounds gather modes all land
within 10% of that. Going below it needs row reuse (process pairs sorted by row so each table row is
read once per batch, with x and y in cache), not a different token-order gather.
"""

import jax
import jax.numpy as jnp


def _pad_rows(a, n_padded):
  pad = n_padded - a.shape[0]
  return a if pad == 0 else jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))


def _chunked(arrays, chunk):
  """Pads the leading (token) axis to a multiple of chunk and splits it into [n_chunks, chunk, ...]."""
  n = arrays[0].shape[0]
  n_padded = -(-n // chunk) * chunk
  return [_pad_rows(a, n_padded).reshape((n_padded // chunk, chunk) + a.shape[1:]) for a in arrays]


def _unchunk(a, n):
  return a.reshape((-1,) + a.shape[2:])[:n]


def _pre_activation(x_cD, w_in_RD, rows_cS, bias_R):
  w_in_cSD = w_in_RD[rows_cS].astype(x_cD.dtype)
  h_cS = jnp.einsum("cd,csd->cs", x_cD, w_in_cSD, preferred_element_type=jnp.float32)
  if bias_R is not None:
    h_cS = h_cS + bias_R[rows_cS].astype(jnp.float32)
  return h_cS, w_in_cSD


def forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, activation, options):
  """Returns y [N, D] (x's dtype) and the pre-activations h [N, S] (float32, kept for backward)."""
  n_tokens = x_ND.shape[0]
  dtype = x_ND.dtype

  def step(_, chunk):
    x_cD, rows_cS, gates_cS = chunk
    h_cS, _ = _pre_activation(x_cD, w_in_RD, rows_cS, bias_R)
    a_cS = (activation(h_cS) * gates_cS.astype(jnp.float32)).astype(dtype)
    w_out_cSD = w_out_RD[rows_cS].astype(dtype)
    y_cD = jnp.einsum("cs,csd->cd", a_cS, w_out_cSD, preferred_element_type=jnp.float32)
    return None, (y_cD.astype(dtype), h_cS)

  _, (y, h) = jax.lax.scan(step, None, _chunked([x_ND, rows_NS, gates_NS], options.token_chunk))
  return _unchunk(y, n_tokens), _unchunk(h, n_tokens)


def forward_from_pre_activation(x_ND, w_out_RD, rows_NS, gates_NS, h_NS, activation, options):
  """y [N, D] (x's dtype) from given pre-activations h [N, S]: only w_out rows are gathered."""
  n_tokens = x_ND.shape[0]
  dtype = x_ND.dtype

  def step(_, chunk):
    rows_cS, gates_cS, h_cS = chunk
    a_cS = (activation(h_cS) * gates_cS.astype(jnp.float32)).astype(dtype)
    w_out_cSD = w_out_RD[rows_cS].astype(dtype)
    y_cD = jnp.einsum("cs,csd->cd", a_cS, w_out_cSD, preferred_element_type=jnp.float32)
    return None, y_cD.astype(dtype)

  _, y = jax.lax.scan(step, None, _chunked([rows_NS, gates_NS, h_NS], options.token_chunk))
  return _unchunk(y, n_tokens)


def backward_rows(dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, activation, options):
  """Token-side gradients from one more chunked gather pass.

  Returns dx [N, D] (dy's dtype), dgates [N, S], and the float32 per-pair coefficients
  coef_in = dL/dh (multiplies x into w_in's rows) and coef_out = gate * act(h) (multiplies dy
  into w_out's rows).
  """
  n_tokens = dy_ND.shape[0]
  dtype = dy_ND.dtype

  def step(_, chunk):
    dy_cD, h_cS, rows_cS, gates_cS = chunk
    w_out_cSD = w_out_RD[rows_cS].astype(dtype)
    dyw_cS = jnp.einsum("cd,csd->cs", dy_cD, w_out_cSD, preferred_element_type=jnp.float32)
    act_cS, act_vjp = jax.vjp(activation, h_cS)
    gates_cS = gates_cS.astype(jnp.float32)
    (coef_in_cS,) = act_vjp(gates_cS * dyw_cS)
    w_in_cSD = w_in_RD[rows_cS].astype(dtype)
    dx_cD = jnp.einsum("cs,csd->cd", coef_in_cS.astype(dtype), w_in_cSD, preferred_element_type=jnp.float32)
    return None, (dx_cD.astype(dtype), act_cS * dyw_cS, coef_in_cS, act_cS * gates_cS)

  chunks = _chunked([dy_ND, h_NS, rows_NS, gates_NS], options.token_chunk)
  _, outs = jax.lax.scan(step, None, chunks)
  return tuple(_unchunk(a, n_tokens) for a in outs)

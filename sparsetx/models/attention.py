"""Causal self-attention over packed rows, three ways: `config.model.attention` = auto | xla | cudnn | splash.

Every implementation computes the same thing: query t reads key s iff s <= t and both belong to the same
document (segment id), softmax statistics (max, sum, logsumexp) in float32, output in the inputs' dtype.

More: docs/modules.md, sparsetx/models/attention.py.
"""

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from sparsetx import config as config_lib
from sparsetx.kernels import platform
from sparsetx.parallel import attention_placement

IMPLEMENTATIONS = config_lib.ATTENTION_IMPLEMENTATIONS
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_TARGET = {"cudnn": "gpu", "splash": "tpu"}  # where each fused kernel runs natively


def resolve(implementation: str, dtype) -> str:
  """The implementation `auto` stands for on this backend (others are returned as given)."""
  if implementation != "auto":
    return implementation
  backend = platform.target().platform
  if backend == "gpu":
    return "cudnn" if jnp.dtype(dtype) in map(jnp.dtype, CUDNN_DTYPES) else "xla"
  return "splash" if backend == "tpu" else "xla"


def causal_segment_mask(segment_ids_BT):
  """[B,1,T,T] True where query t may read key s: s <= t within the same segment."""
  T = segment_ids_BT.shape[1]
  causal_TT = jnp.tril(jnp.ones((T, T), bool))
  same_BTT = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
  return (causal_TT[None] & same_BTT)[:, None]


def xla_attention(q_BTHK, k_BSHK, v_BSHK, mask_B1TS, on_probabilities=lambda probs_BHTS: probs_BHTS):
  """out [B,T,H,K] in q's dtype, for any mask (so also the decode cache's [B,1,T,max_len]).

  `on_probabilities` sees the [B,H,T,S] float32 pattern before it mixes the values (the model's tap).
  """
  K = q_BTHK.shape[-1]
  logits_BHTS = jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BSHK, preferred_element_type=jnp.float32) / K**0.5
  logits_BHTS = jnp.where(mask_B1TS, logits_BHTS, jnp.finfo(jnp.float32).min)
  probs_BHTS = on_probabilities(jax.nn.softmax(logits_BHTS, axis=-1))
  return jnp.einsum("bhts,bshk->bthk", probs_BHTS.astype(q_BTHK.dtype), v_BSHK)


def fused_attention(implementation: str, q_BTHK, k_BTHK, v_BTHK, segment_ids_BT):
  """Causal self-attention within segments by a fused kernel (cudnn | splash): out [B,T,H,K]."""
  _check_backend(implementation, q_BTHK.dtype)
  if implementation == "cudnn":
    kernel = cudnn_attention
  else:
    interpret = platform.target().platform != _TARGET[implementation]
    kernel = lambda q, k, v, s: splash_attention(q, k, v, s, interpret=interpret)  # noqa: E731
  return attention_placement.on_own_rows_and_heads(kernel, q_BTHK, k_BTHK, v_BTHK, segment_ids_BT)


def cudnn_attention(q_BTHK, k_BTHK, v_BTHK, segment_ids_BT):
  """cuDNN flash attention: causal mask type plus the same-segment mask (an additive bias inside JAX)."""
  same_B1TS = (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q_BTHK, k_BTHK, v_BTHK, mask=same_B1TS, is_causal=True, implementation="cudnn")


def splash_attention(q_BTHK, k_BTHK, v_BTHK, segment_ids_BT, interpret: bool = False):
  """Splash attention (heads-major per row, vmapped over the batch); splash takes the query pre-scaled."""
  B, T, H, K = q_BTHK.shape
  T_pad = -(-T // 128) * 128  # the kernel's blocks are multiples of 128 lanes
  block = next(b for b in (512, 256, 128) if T_pad % b == 0)
  q_BHTK, k_BHTK, v_BHTK = (_pad_length(a, T_pad).transpose(0, 2, 1, 3) for a in (q_BTHK, k_BTHK, v_BTHK))
  segments_BT = _pad_length(segment_ids_BT, T_pad)
  mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((T_pad, T_pad))] * H)
  sizes = splash_kernel.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  kernel = splash_kernel.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
  q_BHTK = (q_BHTK * (1.0 / math.sqrt(K))).astype(q_BTHK.dtype)
  out_BHTK = jax.vmap(kernel)(q_BHTK, k_BHTK, v_BHTK, segment_ids=splash_kernel.SegmentIds(segments_BT, segments_BT))
  return out_BHTK.transpose(0, 2, 1, 3)[:, :T]


def _pad_length(a_BT, length: int):
  """a [B,T,...] zero-padded at the end of T to `length`."""
  pad = [(0, 0)] * a_BT.ndim
  pad[1] = (0, length - a_BT.shape[1])
  return jnp.pad(a_BT, pad)


def _check_backend(implementation: str, dtype) -> None:
  backend = platform.target().platform
  if implementation == "cudnn":
    if backend != "gpu":
      raise config_lib.ConfigError(
        f"config.model.attention='cudnn' runs on NVIDIA GPUs only, and this process runs on {backend}; "
        "use 'auto' (or 'xla') here."
      )
    if jnp.dtype(dtype) not in map(jnp.dtype, CUDNN_DTYPES):
      raise config_lib.ConfigError(
        f"config.model.attention='cudnn' has no {jnp.dtype(dtype).name} kernel; set config.model.dtype to "
        "'bfloat16' or 'float16', or use attention='xla'."
      )
  elif backend in ("gpu", "tpu") and backend != _TARGET[implementation]:
    use = "splash" if backend == "tpu" else "cudnn"
    raise config_lib.ConfigError(
      f"config.model.attention={implementation!r} is a {_TARGET[implementation].upper()} kernel and this process "
      f"runs on {backend}; use 'auto' or '{use}'."
    )

"""The decoder-only language model: token embedding, N blocks, final norm, LM head.

More: docs/modules.md, sparsetx/models/transformer.py.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from sparsetx import config as config_lib
from sparsetx import scopes
from sparsetx.models import attention as attention_lib
from sparsetx.models.ffn.common import dense_init
from sparsetx.models.ffn.registry import make_ffn
from sparsetx.models.taps import tap


def make_norm(cfg, name: str) -> nn.Module:
  scale_init = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
  common = dict(epsilon=cfg.norm_eps, dtype=jnp.float32, param_dtype=jnp.dtype(cfg.param_dtype), name=name)
  if cfg.norm == "rmsnorm":
    return nn.RMSNorm(scale_init=scale_init, **common)
  return nn.LayerNorm(
    scale_init=scale_init, bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)), **common
  )


def apply_rotary(x_BTHK, positions_BT, rotary_dims: int, base: float):
  """GPT-NeoX rotary: rotate-half on the first `rotary_dims` of each head, the rest pass through."""
  if rotary_dims == 0:
    return x_BTHK
  inv_freq = 1.0 / (base ** (jnp.arange(0, rotary_dims, 2, dtype=jnp.float32) / rotary_dims))
  angles_BTF = positions_BT[..., None].astype(jnp.float32) * inv_freq[None, None, :]
  angles_BT1R = jnp.concatenate([angles_BTF, angles_BTF], axis=-1)[:, :, None, :]
  rot, rest = x_BTHK[..., :rotary_dims].astype(jnp.float32), x_BTHK[..., rotary_dims:]
  half = rotary_dims // 2
  rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
  rot = rot * jnp.cos(angles_BT1R) + rotated * jnp.sin(angles_BT1R)
  return jnp.concatenate([rot.astype(x_BTHK.dtype), rest], axis=-1)


attention_mask = attention_lib.causal_segment_mask  # [B,1,T,T]: s <= t within the same segment


def decode_mask(positions_BT, cache_len: int):
  """[B,1,T,L] True where query t may read cache slot s: s <= its position (later slots are unwritten or stale)."""
  return (jnp.arange(cache_len)[None, None, :] <= positions_BT[:, :, None])[:, None]


class Attention(nn.Module):
  """Multi-head self-attention with rotary positions, by `cfg.attention`.

  The XLA path (the reference) also runs where the fused kernels cannot:
  - decoding: queries read a cache of max_len slots up to their own positions (not the square causal
    pattern the kernels compute), and a step has T = 1, so there is no T x T matrix to save;
  - patching `attention_probabilities` (the fused kernels never form the pattern).
  Only the XLA path taps `attention_probabilities`; the interp tools build their model with `with_xla_attention`.
  """

  cfg: object  # the model config (FrozenConfigDict)
  decode: bool = False  # keys/values of earlier positions come from the `cache` collection; mask is [B,1,T,max_len]

  @nn.compact
  def __call__(self, x_BTD, positions_BT, mask_B1TS, segment_ids_BT=None):
    """mask_B1TS: the XLA path's mask (None when a fused kernel runs); segment_ids_BT: the fused kernels'."""
    cfg = self.cfg
    H, K = cfg.d_model // cfg.head_dim, cfg.head_dim
    dtype = jnp.dtype(cfg.dtype)

    def project(name, features, axis, kernel_names, bias_names):
      return nn.DenseGeneral(
        features,
        axis=axis,
        use_bias=cfg.use_bias,
        dtype=dtype,
        param_dtype=jnp.dtype(cfg.param_dtype),
        kernel_init=dense_init(cfg.init_std, kernel_names),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, bias_names),
        name=name,
      )

    q_BTHK, k_BTHK, v_BTHK = (
      project(name, (H, K), -1, ("embed", "heads", "kv"), ("heads", "kv"))(x_BTD) for name in ("query", "key", "value")
    )
    rotary_dims = int(K * cfg.rotary_fraction)
    q_BTHK = apply_rotary(q_BTHK, positions_BT, rotary_dims, cfg.rope_base)
    k_BTHK = apply_rotary(k_BTHK, positions_BT, rotary_dims, cfg.rope_base)
    k_BSHK, v_BSHK = k_BTHK, v_BTHK  # S = T, or the cache length when decoding (the mask covers S)
    if self.decode:
      k_BSHK, v_BSHK = (
        self._cached(name, new_BTHK, positions_BT)
        for name, new_BTHK in (("cached_key", k_BTHK), ("cached_value", v_BTHK))
      )
    implementation = attention_implementation(cfg, self.decode)
    if self.has_variable("patches", "attention_probabilities"):
      implementation = "xla"
    if implementation == "xla":
      if mask_B1TS is None:
        mask_B1TS = attention_lib.causal_segment_mask(segment_ids_BT)
      out_BTHK = attention_lib.xla_attention(
        q_BTHK, k_BSHK, v_BSHK, mask_B1TS, lambda probs_BHTS: tap(self, "attention_probabilities", probs_BHTS)
      )
    else:
      out_BTHK = attention_lib.fused_attention(implementation, q_BTHK, k_BTHK, v_BTHK, segment_ids_BT)
    return project("out", cfg.d_model, (-2, -1), ("heads", "kv", "embed"), ("embed",))(out_BTHK)

  def _cached(self, name: str, new_BTHK, positions_BT):
    """The cache variable `name` ([B, max_len, H, K]) with the new keys or values written at their positions.

    Positions past the cache are dropped (jit cannot raise on values): callers stay within max_len, as the Sampler does.
    """
    B, _, H, K = new_BTHK.shape
    cache = self.variable("cache", name, jnp.zeros, (B, self.cfg.max_len, H, K), new_BTHK.dtype)
    cache.value = cache.value.at[jnp.arange(B)[:, None], positions_BT].set(new_BTHK, mode="drop")
    return cache.value


def attention_implementation(cfg, decode: bool = False) -> str:
  """What `cfg.attention` runs on this backend: xla when decoding (see `Attention`), `auto` resolved."""
  if decode:
    return "xla"
  return attention_lib.resolve(cfg.get("attention", "auto"), jnp.dtype(cfg.dtype))


def with_xla_attention(cfg):
  """`cfg` with attention='xla': the model whose traces hold `attention_probabilities` (what interp reads)."""
  model = ml_collections.ConfigDict(cfg.to_dict())
  model.attention = "xla"
  return ml_collections.FrozenConfigDict(model)


class Block(nn.Module):
  cfg: object
  decode: bool = False  # see Attention.decode

  @nn.compact
  def __call__(self, x_BTD, positions_BT, mask_B1TS, segment_ids_BT=None):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    x_BTD = nn.with_logical_constraint(x_BTD, ("batch", "length", "embed"))
    x_BTD = tap(self, "layer_input", x_BTD)
    attn_in_BTD = tap(self, "attention_norm_output", make_norm(cfg, "attention_norm")(x_BTD).astype(dtype))
    attention = Attention(cfg, self.decode, name="attention")
    attn_BTD = tap(self, "attention_output", attention(attn_in_BTD, positions_BT, mask_B1TS, segment_ids_BT))
    residual_BTD = x_BTD + attn_BTD if cfg.block == "sequential" else x_BTD
    mlp_in_BTD = tap(self, "mlp_input", make_norm(cfg, "mlp_norm")(residual_BTD).astype(dtype))
    ffn_BTD = tap(self, "mlp_output", make_ffn(cfg, name="mlp")(mlp_in_BTD))
    out_BTD = tap(self, "layer_output", (x_BTD + attn_BTD + ffn_BTD).astype(x_BTD.dtype))
    return out_BTD


def block_config(cfg, layer: int):
  """The model config block `layer` is built from: the same, with `dense_ffn` as its `ffn` when
  `cfg.ffn_layers` leaves this layer out (mixed models from sparsetx/tools/sparsify.py)."""
  if layer in config_lib.ffn_layer_indices(cfg):
    return cfg
  model = ml_collections.ConfigDict(cfg.to_dict())  # a copy: FrozenConfigDict.as_configdict() shares cfg's own storage
  model.ffn = model.dense_ffn
  return ml_collections.FrozenConfigDict(model)


class LMHead(nn.Module):
  """The untied LM head: its kernel [D, vocab] (nn.Dense's parameter, name and init) applied by `head_dot`."""

  cfg: ml_collections.FrozenConfigDict

  @nn.compact
  def __call__(self, x_BTD):
    init = dense_init(self.cfg.init_std, ("embed", "vocab"))
    kernel_DV = self.param("kernel", init, (self.cfg.d_model, self.cfg.vocab_size), jnp.dtype(self.cfg.param_dtype))
    return head_dot(self.cfg, "btd,dv->btv", x_BTD, kernel_DV)


class Transformer(nn.Module):
  """tokens [B,T] (int) -> logits [B,T,vocab] float32.

  decode=True (with `cache` mutable, see init_cache): tokens at `positions_BT` (default: the cache index
  onwards) attend to themselves and the cached earlier positions; segment ids are not used.
  """

  cfg: object  # the model config (FrozenConfigDict)

  @nn.compact
  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, decode: bool = False, head: bool = True):
    """head=False returns the final norm's output [B,T,D] float32 instead of the logits: the train step's chunked
    loss applies the head (`head_logits`) a slice of tokens at a time."""
    cfg = self.cfg
    if decode:
      positions_BT, mask_B1TS = self._decode_positions(tokens_BT, positions_BT, segment_ids_BT)
    else:
      if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
      if segment_ids_BT is None:
        segment_ids_BT = jnp.ones_like(tokens_BT)
      # The [B,1,T,T] mask only for the XLA path; the fused kernels read the segment ids.
      mask_B1TS = attention_mask(segment_ids_BT) if attention_implementation(cfg) == "xla" else None

    embed = nn.Embed(
      cfg.vocab_size,
      cfg.d_model,
      dtype=jnp.dtype(cfg.dtype),
      param_dtype=jnp.dtype(cfg.param_dtype),
      embedding_init=dense_init(cfg.init_std, ("vocab", "embed")),
      name="embed",
    )
    x_BTD = embed(tokens_BT)
    x_BTD = tap(self, "token_embeddings", x_BTD)

    block = remat_block(cfg) if not decode else Block  # remat saves memory for gradients only
    scan = scans_layers(cfg) and not decode and not self.is_initializing() and not self._patched()
    for group in layer_groups(cfg) if scan else [(i,) for i in range(cfg.n_layers)]:
      if len(group) == 1:
        i = group[0]
        x_BTD = block(block_config(cfg, i), decode, name=f"layers_{i}")(x_BTD, positions_BT, mask_B1TS, segment_ids_BT)
        continue
      record = self.is_mutable_collection("intermediates")
      layer_params = [nn.meta.unbox(self.variables["params"][f"layers_{i}"]) for i in group]
      x_BTD, sown = scan_blocks(
        block_config(cfg, group[0]), layer_params, x_BTD, positions_BT, mask_B1TS, segment_ids_BT, record
      )
      for j, i in enumerate(group if record else ()):  # each layer's taps under its own name, as the loop sows them
        self.put_variable("intermediates", f"layers_{i}", jax.tree.map(lambda a, j=j: a[j], sown))

    x_BTD = tap(self, "final_norm_output", make_norm(cfg, "final_norm")(x_BTD))
    if not head and not self.is_initializing():
      return x_BTD
    if cfg.tie_embeddings:
      logits_BTV = head_dot(cfg, "btd,vd->btv", x_BTD, embed.embedding)
    else:
      logits_BTV = LMHead(cfg, name="lm_head")(x_BTD)
    logits_BTV = tap(self, "logits", logits_BTV.astype(jnp.float32))
    return nn.with_logical_constraint(logits_BTV, ("batch", "length", "vocab"))

  def _patched(self) -> bool:
    """Whether the caller passed patches (interp's do-interventions name them per layer: the loop applies them)."""
    return any(col in self.variables for col in ("patches", "patch_masks"))

  def _decode_positions(self, tokens_BT, positions_BT, segment_ids_BT):
    """(positions [B,T], mask [B,1,T,max_len]) of a decode call; advances the cache index past its tokens."""
    B, T = tokens_BT.shape
    if segment_ids_BT is not None:
      raise config_lib.ConfigError(
        "decode=True takes one sequence per row; drop segment_ids (they are for packed rows)."
      )
    if T > self.cfg.max_len:
      raise config_lib.ConfigError(
        f"a decode call of {T} tokens does not fit the cache of config.model.max_len={self.cfg.max_len} positions; "
        "shorten the prompt (keep its newest tokens) or use a model with a longer window."
      )
    index = self.variable("cache", "cache_index", jnp.zeros, (B,), jnp.int32)
    if positions_BT is None:
      positions_BT = index.value[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    positions_BT = jnp.asarray(positions_BT, jnp.int32)
    index.value = positions_BT[:, -1] + 1
    return positions_BT, decode_mask(positions_BT, self.cfg.max_len)


def head_dtype(cfg):
  """The dtype the LM head's dot reads its operands in: float32, or the compute dtype (cfg.logits_dot_in_fp32)."""
  return jnp.dtype(jnp.float32 if cfg.get("logits_dot_in_fp32", True) else cfg.dtype)


def head_dot(cfg, spec: str, x, w):
  """einsum(spec, x, w) as the LM head computes it: operands in `head_dtype`, float32 sums and result. On the
  compute dtype's operands the logits' cotangent enters the backward's two dots rounded to that dtype, as every
  other layer's does (`_narrow_head_dot`), so all four of the head's matmuls run at its rate."""
  dtype = head_dtype(cfg)
  x, w = x.astype(dtype), w.astype(dtype)
  if dtype == jnp.float32:
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
  return _narrow_head_dot(spec, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _narrow_head_dot(spec, x, w):
  return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def _narrow_head_dot_fwd(spec, x, w):
  return _narrow_head_dot(spec, x, w), (x, w)


def _narrow_head_dot_bwd(spec, residuals, g):
  x, w = residuals
  dx, dw = head_dot_grads(spec, x, w, g)
  return dx.astype(x.dtype), dw.astype(w.dtype)


def head_dot_grads(spec: str, x, w, g):
  """(dx, dw) of einsum(spec, x, w) for the logits' cotangent g, float32: g enters both dots in the operands' dtype
  (bf16 on the narrow head, as every other layer's backward reads it), the sums are float32 and the caller rounds
  each result once (a contraction over several axes may otherwise round partial sums)."""
  lhs, rest = spec.split(",")
  rhs, out = rest.split("->")
  g = g.astype(x.dtype)
  dx = jnp.einsum(f"{out},{rhs}->{lhs}", g, w, preferred_element_type=jnp.float32)
  return dx, jnp.einsum(f"{lhs},{out}->{rhs}", x, g, preferred_element_type=jnp.float32)


_narrow_head_dot.defvjp(_narrow_head_dot_fwd, _narrow_head_dot_bwd)


def head_logits(cfg, params, x_BTD):
  """The LM head on final-norm outputs x_BTD (any leading shape): float32 logits [..., vocab], the product
  `Transformer` computes (its tied einsum, or its lm_head Dense: the same dot), from the unboxed `params`."""
  if cfg.tie_embeddings:
    return head_dot(cfg, "...d,vd->...v", x_BTD, params["embed"]["embedding"])
  return head_dot(cfg, "...d,dv->...v", x_BTD, params["lm_head"]["kernel"])


def head_params(cfg, params) -> dict:
  """The subtree of `params` that `head_logits` reads (what the chunked loss differentiates)."""
  name = "embed" if cfg.tie_embeddings else "lm_head"
  return {name: params[name]}


def remat_block(cfg):
  """Block, rematerialized by `cfg.remat`: none, full (saves only the block's inputs) or a policy of
  `jax.checkpoint_policies` naming what the forward keeps (e.g. dots_saveable: matmul outputs)."""
  policy = config_lib.remat_policy(cfg)
  if policy == "none":
    return Block
  return nn.remat(Block, policy=checkpoint_policy(policy))


def checkpoint_policy(policy: str):
  """The jax.checkpoint policy of a remat name other than none: full saves nothing (None) but the block's input;
  save_routing the values named in scopes.SAVED_BY_NAME (the attention output, the sparse layers' routed indices
  and gates), so the backward recomputes no router or top-k; save_dots the matmul outputs (dots_saveable)."""
  if policy == "full":
    return None
  if policy == "save_routing":
    return jax.checkpoint_policies.save_only_these_names(*scopes.SAVED_BY_NAME)
  return getattr(jax.checkpoint_policies, "dots_saveable" if policy == "save_dots" else policy)


def scans_layers(cfg) -> bool:
  """Whether the forward runs each group of like layers as one `lax.scan` (`cfg.scan_layers`; configs saved
  before the field read False). Init, decoding and patched calls always run the per-layer loop."""
  return bool(cfg.get("scan_layers", False))


def layer_groups(cfg) -> tuple[tuple[int, ...], ...]:
  """The runs of consecutive layers built from the same block config (`block_config`: the sparse `ffn` or
  `dense_ffn` of a mixed model), in order: each run of two or more compiles as one scanned body."""
  sparse = set(config_lib.ffn_layer_indices(cfg))
  groups: list[list[int]] = []
  for i in range(cfg.n_layers):
    if groups and (groups[-1][-1] in sparse) == (i in sparse):
      groups[-1].append(i)
    else:
      groups.append([i])
  return tuple(tuple(group) for group in groups)


def scan_blocks(cfg, layer_params: list, x_BTD, positions_BT, mask_B1TS, segment_ids_BT, record: bool):
  """(output, each layer's sown `intermediates` stacked on a leading layer axis) of the blocks whose parameter
  trees are `layer_params`, run in order as one `lax.scan` over their parameters stacked inside the step.

  Why stack here and not in the state: the train state, every checkpoint and every reader (restore, elastic resume,
  export, import, interp, sparsify) keep the per-layer tree `layers_i`, so the format is the same scanned or not and
  either form resumes the other's checkpoints. The price is one stacked copy of the group's parameters (and of
  their gradients) inside the step. Each layer's body is rematerialized by `cfg.remat` as `remat_block` does.
  """
  block = Block(cfg)

  def body(x_BTD, params):
    variables = {"params": params}
    args = (x_BTD, positions_BT, mask_B1TS, segment_ids_BT)
    if not record:
      return block.apply(variables, *args), {}
    out_BTD, state = block.apply(variables, *args, mutable=["intermediates"])
    return out_BTD, state.get("intermediates", {})

  policy = config_lib.remat_policy(cfg)
  if policy != "none":
    body = jax.checkpoint(body, policy=checkpoint_policy(policy), prevent_cse=False)
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layer_params)
  return jax.lax.scan(body, x_BTD, stacked)


def init_cache(model: Transformer, batch_size: int):
  """The zeroed decode cache of `model` for `batch_size` rows of max_len positions (shapes only: no params made)."""
  tokens_B1 = jnp.zeros((batch_size, 1), jnp.int32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens_B1, decode=True))["cache"]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

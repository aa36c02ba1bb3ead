"""PyTorch reimplementation of sparsetx's decoder (sparsetx/models/transformer.py) for exported checkpoints.

More: docs/modules.md, sparsetx/hf/modeling/modeling_sparsetx.py.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutput

from .configuration_sparsetx import SparsetxConfig

ACTIVATIONS = {
  "identity": lambda h: h,
  "relu": F.relu,
  "gelu": F.gelu,  # exact (erf)
  "swish": F.silu,
}
# config.model.ffn.gelu_approximate None: each layer's official form (sparsetx/models/ffn/common.py)
OFFICIAL_GELU_APPROXIMATE = {"sgatlin": True, "peer": True, "fff": False}


def gelu_for(ffn):
  """GELU in the form the layer's config picks: tanh approximation or exact erf."""
  choice = ffn.get("gelu_approximate")
  approximate = OFFICIAL_GELU_APPROXIMATE.get(ffn.get("type"), False) if choice is None else bool(choice)
  return (lambda h: F.gelu(h, approximate="tanh")) if approximate else F.gelu


def activation_for(ffn):
  return gelu_for(ffn) if ffn["activation"] == "gelu" else ACTIVATIONS[ffn["activation"]]


def n_keys_for(d_ffw: int) -> int:
  return math.isqrt(d_ffw)


class Dense(nn.Module):
  """A flax Dense/DenseGeneral: `kernel` [*in_shape, *out_shape] contracted over the last len(in_shape) axes of x."""

  def __init__(self, in_shape, out_shape, use_bias=False, float32=False):
    super().__init__()
    self.in_shape, self.out_shape, self.float32 = tuple(in_shape), tuple(out_shape), float32
    self.kernel = nn.Parameter(torch.empty(*self.in_shape, *self.out_shape))
    self.bias = nn.Parameter(torch.empty(*self.out_shape)) if use_bias else None

  def forward(self, x):
    lead = x.shape[: x.dim() - len(self.in_shape)]
    n_in, n_out = math.prod(self.in_shape), math.prod(self.out_shape)
    kernel, bias = self.kernel, self.bias
    if self.float32:  # routers and the head compute in float32 whatever the weights' dtype, as in sparsetx
      x, kernel, bias = x.float(), kernel.float(), None if bias is None else bias.float()
    y = (x.reshape(-1, n_in) @ kernel.reshape(n_in, n_out)).reshape(*lead, *self.out_shape)
    return y if bias is None else y + bias


class Embed(nn.Module):
  """flax Embed: the `embedding` table [V, D]."""

  def __init__(self, vocab_size, d_model):
    super().__init__()
    self.embedding = nn.Parameter(torch.empty(vocab_size, d_model))


class Norm(nn.Module):
  """flax RMSNorm (`scale`) or LayerNorm (`scale`, `bias`, variance as E[x^2] - E[x]^2)."""

  def __init__(self, cfg):
    super().__init__()
    self.kind, self.eps = cfg["norm"], cfg["norm_eps"]
    self.scale = nn.Parameter(torch.empty(cfg["d_model"]))
    self.bias = nn.Parameter(torch.empty(cfg["d_model"])) if self.kind == "layernorm" else None

  def forward(self, x):
    """Computed in float32 (returned in float32: callers cast where sparsetx does)."""
    x = x.float()
    if self.kind == "rmsnorm":
      return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.scale.float()
    mean = x.mean(-1, keepdim=True)
    var = (x.square().mean(-1, keepdim=True) - mean.square()).clamp_min(0.0)
    return (x - mean) * torch.rsqrt(var + self.eps) * self.scale.float() + self.bias.float()


def apply_rotary(x_BTHK, positions_BT, rotary_dims: int, base: float):
  """GPT-NeoX rotary on the first `rotary_dims` of each head; the rest pass through."""
  if rotary_dims == 0:
    return x_BTHK
  exponent = torch.arange(0, rotary_dims, 2, dtype=torch.float32, device=x_BTHK.device) / rotary_dims
  inv_freq = 1.0 / torch.pow(torch.tensor(base, dtype=torch.float32, device=x_BTHK.device), exponent)
  angles_BTF = positions_BT[..., None].to(torch.float32) * inv_freq
  angles_BT1R = torch.cat([angles_BTF, angles_BTF], dim=-1)[:, :, None, :]
  rot, rest = x_BTHK[..., :rotary_dims].float(), x_BTHK[..., rotary_dims:]
  half = rotary_dims // 2
  rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
  rot = rot * torch.cos(angles_BT1R) + rotated * torch.sin(angles_BT1R)
  return torch.cat([rot.to(x_BTHK.dtype), rest], dim=-1)


class Attention(nn.Module):
  def __init__(self, cfg):
    super().__init__()
    D, K = cfg["d_model"], cfg["head_dim"]
    H = D // K
    self.head_dim, self.rope_base = K, cfg["rope_base"]
    self.rotary_dims = int(K * cfg["rotary_fraction"])
    bias = cfg["use_bias"]
    self.query, self.key, self.value = (Dense((D,), (H, K), bias) for _ in range(3))
    self.out = Dense((H, K), (D,), bias)

  def forward(self, x_BTD, positions_BT, mask_B1TS):
    q_BTHK = apply_rotary(self.query(x_BTD), positions_BT, self.rotary_dims, self.rope_base)
    k_BTHK = apply_rotary(self.key(x_BTD), positions_BT, self.rotary_dims, self.rope_base)
    v_BTHK = self.value(x_BTD)
    logits_BHTS = torch.einsum("bthk,bshk->bhts", q_BTHK.float(), k_BTHK.float()) / self.head_dim**0.5
    logits_BHTS = logits_BHTS.masked_fill(~mask_B1TS, torch.finfo(torch.float32).min)
    probs_BHTS = torch.softmax(logits_BHTS, dim=-1)
    return self.out(torch.einsum("bhts,bshk->bthk", probs_BHTS.to(v_BTHK.dtype), v_BTHK))


def gated_gather(
  x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, activation, bias_R=None, token_chunk=1024, gate_inside_activation=True
):
  """y[n] = sum_s a(h[n,s], gates[n,s]) * w_out[rows[n,s]], h[n,s] = <w_in[rows[n,s]], x[n]> + bias[rows[n,s]],
  a = act(g * h) with the gate inside the activation (sgatlin, its official code) else g * act(h) (PEER).

  Chunked over tokens so the gathered rows of at most `token_chunk` tokens exist at once. Computed in
  float32, returned in x's dtype.
  """
  outputs = []
  for start in range(0, x_ND.shape[0], token_chunk):
    x_nD, rows_nS = x_ND[start : start + token_chunk].float(), rows_NS[start : start + token_chunk]
    h_nS = torch.einsum("nd,nsd->ns", x_nD, w_in_RD[rows_nS].float())
    if bias_R is not None:
      h_nS = h_nS + bias_R[rows_nS].float()
    g_nS = gates_NS[start : start + token_chunk].float()
    h_nS = activation(g_nS * h_nS) if gate_inside_activation else g_nS * activation(h_nS)
    outputs.append(torch.einsum("ns,nsd->nd", h_nS, w_out_RD[rows_nS].float()))
  return torch.cat(outputs, dim=0).to(x_ND.dtype)


def _top_k_lowest_first(scores, k: int):
  """Top-k over the last axis with equal scores going to the lower index, as the JAX model picks them
  (torch.topk leaves the order of ties open)."""
  order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
  return torch.gather(scores, -1, order), order


def product_key_top_k(scores1, scores2, k: int):
  """Top-k of {s1[i] + s2[j]} over the last axis: (values descending, indices i * n_keys + j); equal sums
  go to the lower neuron index, as in sparsetx.models.ffn.product_keys."""
  n_keys = scores1.shape[-1]
  s1, i1 = _top_k_lowest_first(scores1, k)
  s2, i2 = _top_k_lowest_first(scores2, k)
  sums = (s1[..., :, None] + s2[..., None, :]).flatten(-2)
  ids = (i1[..., :, None] * n_keys + i2[..., None, :]).flatten(-2)
  by_id = torch.argsort(ids, dim=-1)
  sums, ids = torch.gather(sums, -1, by_id), torch.gather(ids, -1, by_id)
  values, best = _top_k_lowest_first(sums, k)
  return values, torch.gather(ids, -1, best)


def subkey_bias(ffn, channels):
  """The sub-keys' selection bias (loss-free balancing), [C, 2, n_keys] or, for a table the channels share
  (channels None), [2, n_keys]; None without bias_update_rate."""
  if not ffn.get("bias_update_rate", 0.0):
    return None
  n_keys = n_keys_for(ffn["d_ffw"])
  return nn.Parameter(torch.empty(*(() if channels is None else (channels,)), 2, n_keys))


def biased_product_key_top_k(scores1, scores2, bias, k: int):
  """product_key_top_k chosen on the scores plus the selection bias (broadcast to [C, 2, n_keys]), valued by the
  unbiased scores."""
  if bias is None:
    return product_key_top_k(scores1, scores2, k)
  n_keys = scores1.shape[-1]
  bias_C2N = bias.float().expand(scores1.shape[-2], 2, n_keys)
  _, ids = product_key_top_k(scores1 + bias_C2N[:, 0], scores2 + bias_C2N[:, 1], k)
  values = torch.gather(scores1, -1, ids // n_keys) + torch.gather(scores2, -1, ids % n_keys)
  return values, ids


class ProductKeyRouter(nn.Module):
  """sgatlin's router: query = x W_query (shared by the channels); per channel, keys score it in two halves."""

  def __init__(self, ffn, d_model, bias_channels=None):
    super().__init__()
    self.top_k, n_keys = ffn["top_k"], n_keys_for(ffn["d_ffw"])
    self.query = Dense((d_model,), (ffn["d_key"],), float32=True)
    self.keys = Dense((ffn["d_key"],), (2, ffn["n_channels"], n_keys), float32=True)
    self.selection_bias = subkey_bias(ffn, bias_channels)

  def forward(self, x_BTD):
    scores_BT2CN = self.keys(self.query(x_BTD))
    return biased_product_key_top_k(scores_BT2CN[:, :, 0], scores_BT2CN[:, :, 1], self.selection_bias, self.top_k)


class PeerRouter(nn.Module):
  """PEER's router: a query per channel split in two halves, scored against two sub-key sets."""

  def __init__(self, ffn, d_model, bias_channels=None):
    super().__init__()
    C, half = ffn["n_channels"], ffn["d_key"] // 2
    self.top_k, n_keys = ffn["top_k"], n_keys_for(ffn["d_ffw"])
    self.query = Dense((d_model,), (C, 2, half), float32=True)
    self.sub_keys = nn.Parameter(torch.empty(C, 2, n_keys, half))
    self.selection_bias = subkey_bias(ffn, bias_channels)

  def forward(self, x_BTD):
    scores_BTC2N = torch.einsum("btcsh,csnh->btcsn", self.query(x_BTD), self.sub_keys.float())
    return biased_product_key_top_k(scores_BTC2N[..., 0, :], scores_BTC2N[..., 1, :], self.selection_bias, self.top_k)


ROUTERS = {"product": ProductKeyRouter, "peer": PeerRouter}


class Sgatlin(nn.Module):
  """Per channel, the product-key top-k picks k rank-one neurons; gates are the raw scores (product router)."""

  def __init__(self, cfg, ffn):
    super().__init__()
    self.C, self.N, self.router_kind = ffn["n_channels"], ffn["d_ffw"], ffn["router"]
    self.activation = activation_for(ffn)
    self.router = ROUTERS[self.router_kind](ffn, cfg["d_model"], bias_channels=self.C)
    self.experts = nn.Parameter(torch.empty(2, self.C, self.N, cfg["d_model"]))

  def forward(self, x_BTD):
    B, T, D = x_BTD.shape
    scores_BTCK, idx_BTCK = self.router(x_BTD)
    gates_BTCK = scores_BTCK if self.router_kind == "product" else torch.softmax(scores_BTCK, dim=-1)
    channel_offsets = self.N * torch.arange(self.C, device=idx_BTCK.device)[:, None]
    rows_NS = (idx_BTCK + channel_offsets).reshape(B * T, -1)
    table_in, table_out = self.experts[0].reshape(-1, D), self.experts[1].reshape(-1, D)
    y_ND = gated_gather(
      x_BTD.reshape(B * T, D), table_in, table_out, rows_NS, gates_BTCK.reshape(B * T, -1), self.activation
    )
    return y_ND.reshape(B, T, D)


class Peer(nn.Module):
  """PEER: per-channel routers over one shared table of GELU neurons, softmax over each channel's k scores."""

  def __init__(self, cfg, ffn):
    super().__init__()
    self.router = PeerRouter(ffn, cfg["d_model"])
    self.gelu = gelu_for(ffn)
    self.experts = nn.Parameter(torch.empty(2, ffn["d_ffw"], cfg["d_model"]))

  def forward(self, x_BTD):
    B, T, D = x_BTD.shape
    scores_BTCK, idx_BTCK = self.router(x_BTD)
    gates_BTCK = torch.softmax(scores_BTCK, dim=-1)
    y_ND = gated_gather(
      x_BTD.reshape(B * T, D),
      self.experts[0],
      self.experts[1],
      idx_BTCK.reshape(B * T, -1),
      gates_BTCK.reshape(B * T, -1),
      self.gelu,
      gate_inside_activation=False,
    )
    return y_ND.reshape(B, T, D)


class Fff(nn.Module):
  """P binary trees of depth D in heap order; per level z = <x, w_in> + b_in, child 2s+2 if z > 0 else 2s+1."""

  def __init__(self, cfg, ffn):
    super().__init__()
    D = cfg["d_model"]
    self.depth, self.variant = ffn["depth"], ffn["variant"]
    self.gelu = gelu_for(ffn)
    P, N = ffn["n_trees"], 2 ** (ffn["depth"] + 1) - 1
    self.w_in = nn.Parameter(torch.empty(P, N, D))
    self.b_in = nn.Parameter(torch.empty(P, N))
    self.w_out = nn.Parameter(torch.empty(P, N, D))
    self.b_out = nn.Parameter(torch.empty(D))

  def forward(self, x_BTD):
    B, T, D = x_BTD.shape
    x_MD = x_BTD.reshape(B * T, D)
    P = self.w_in.shape[0]
    tree_P = torch.arange(P, device=x_MD.device)
    node_MP = torch.zeros(x_MD.shape[0], P, dtype=torch.long, device=x_MD.device)
    x_MD = x_MD.float()  # logits and sums in float32, as sparsetx
    y_MD = torch.zeros_like(x_MD)
    for _level in range(self.depth + 1):
      z_MP = torch.einsum("md,mpd->mp", x_MD, self.w_in[tree_P, node_MP].float()) + self.b_in[tree_P, node_MP].float()
      a_MP = self.gelu(z_MP) if self.variant == "fff" else z_MP
      y_MD = y_MD + torch.einsum("mp,mpd->md", a_MP, self.w_out[tree_P, node_MP].float())
      node_MP = 2 * node_MP + 1 + (z_MP > 0).long()
    y_MD = y_MD + self.b_out.float()
    if self.variant == "fff_post":
      y_MD = self.gelu(y_MD)
    return y_MD.reshape(B, T, D).to(x_BTD.dtype)


class Moe(nn.Module):
  """GPT-OSS-style MoE: router with bias, top-k experts, softmax over the k logits, SwiGLU experts. Options: sigmoid
  scores normalized over the k picked; a selection bias added to the scores for the choice only (loss-free
  balancing); shared SwiGLU experts every token passes through."""

  def __init__(self, cfg, ffn):
    super().__init__()
    D = cfg["d_model"]
    E, F_, self.top_k = ffn["n_experts"], ffn["d_ffw"], ffn["experts_per_token"]
    self.router = Dense((D,), (E,), use_bias=True, float32=True)
    self.wi_gate = nn.Parameter(torch.empty(E, D, F_))
    self.wi_up = nn.Parameter(torch.empty(E, D, F_))
    self.wo = nn.Parameter(torch.empty(E, F_, D))
    self.sigmoid = ffn.get("router_scores", "softmax") == "sigmoid"
    self.selection_bias = nn.Parameter(torch.empty(E)) if ffn.get("bias_update_rate", 0.0) else None
    shared = ffn.get("n_shared_experts", 0)
    self.shared = SwiGlu(cfg, {"d_ffw": shared * F_}) if shared else None

  def forward(self, x_BTD):
    B, T, D = x_BTD.shape
    x_ND = x_BTD.reshape(B * T, D)
    scores_NE = self.router(x_ND)
    if self.sigmoid:
      scores_NE = torch.sigmoid(scores_NE)
    if self.selection_bias is None:
      top_logits_NK, expert_ids_NK = torch.topk(scores_NE, self.top_k, dim=-1)
    else:  # the biased affinities (sigmoid scores, or softmax over every logit) pick, the unbiased scores gate
      affinity_NE = scores_NE if self.sigmoid else torch.softmax(scores_NE, dim=-1)
      expert_ids_NK = _top_k_lowest_first(affinity_NE + self.selection_bias.float(), self.top_k)[1]
      top_logits_NK = torch.gather(scores_NE, -1, expert_ids_NK)
    if self.sigmoid:
      weights_NK = top_logits_NK / (top_logits_NK.sum(-1, keepdim=True) + 1e-20)
    else:
      weights_NK = torch.softmax(top_logits_NK, dim=-1)
    y_ND = torch.zeros_like(x_ND, dtype=torch.float32)
    for expert in range(self.wi_gate.shape[0]):
      token, slot = torch.nonzero(expert_ids_NK == expert, as_tuple=True)
      if token.numel() == 0:
        continue
      x_nD = x_ND[token]
      h_nF = F.silu(x_nD @ self.wi_gate[expert]) * (x_nD @ self.wi_up[expert])
      y_ND = y_ND.index_add(0, token, (h_nF @ self.wo[expert]).float() * weights_NK[token, slot, None])
    y_BTD = y_ND.reshape(B, T, D).to(x_BTD.dtype)
    return y_BTD if self.shared is None else y_BTD + self.shared(x_BTD)


class Mlp(nn.Module):
  def __init__(self, cfg, ffn):
    super().__init__()
    D, F_, bias = cfg["d_model"], ffn["d_ffw"], cfg["use_bias"]
    self.wi, self.wo = Dense((D,), (F_,), bias), Dense((F_,), (D,), bias)

  def forward(self, x_BTD):
    return self.wo(F.gelu(self.wi(x_BTD)))


class SwiGlu(nn.Module):
  def __init__(self, cfg, ffn):
    super().__init__()
    D, F_, bias = cfg["d_model"], ffn["d_ffw"], cfg["use_bias"]
    self.wi_gate, self.wi_up, self.wo = Dense((D,), (F_,), bias), Dense((D,), (F_,), bias), Dense((F_,), (D,), bias)

  def forward(self, x_BTD):
    return self.wo(F.silu(self.wi_gate(x_BTD)) * self.wi_up(x_BTD))


FFN_LAYERS = {"mlp": Mlp, "swiglu": SwiGlu, "moe": Moe, "peer": Peer, "sgatlin": Sgatlin, "fff": Fff}


def layer_ffn_config(cfg, layer: int) -> dict:
  """`ffn`, or `dense_ffn` for a layer a non-empty `ffn_layers` ("1,3") leaves out (mixed models)."""
  text = (cfg.get("ffn_layers") or "").replace(" ", "")
  listed = {int(part) for part in text.split(",") if part}
  return cfg["ffn"] if not listed or layer in listed else cfg["dense_ffn"]


class SparsetxBlock(nn.Module):
  """sequential: x + attn(norm(x)), then + ffn(norm(.)); parallel: x + attn(ln_1(x)) + ffn(ln_2(x))."""

  def __init__(self, cfg, ffn):
    super().__init__()
    self.sequential = cfg["block"] == "sequential"
    self.attention_norm, self.attention = Norm(cfg), Attention(cfg)
    self.mlp_norm, self.mlp = Norm(cfg), FFN_LAYERS[ffn["type"]](cfg, ffn)

  def forward(self, x_BTD, positions_BT, mask_B1TS):
    attn_BTD = self.attention(self.attention_norm(x_BTD).to(x_BTD.dtype), positions_BT, mask_B1TS)
    ffn_BTD = self.mlp(self.mlp_norm(x_BTD + attn_BTD if self.sequential else x_BTD).to(x_BTD.dtype))
    return x_BTD + attn_BTD + ffn_BTD


class SparsetxPreTrainedModel(PreTrainedModel):
  config_class = SparsetxConfig
  base_model_prefix = "model"
  _no_split_modules = ["SparsetxBlock"]
  _keep_in_fp32_modules_strict = ["selection_bias"]  # loaded in bf16 too: a rounded bias changes near-tied picks
  supports_gradient_checkpointing = False

  @torch.no_grad()
  def _init_weights(self, module):
    """For models built from a config alone (not sparsetx's init; train in sparsetx, export, then load)."""
    std = self.config.sparsetx_model.get("init_std", 0.02)
    for name, param in module.named_parameters(recurse=False):
      if name == "scale":
        init.ones_(param)
      elif name.startswith("b") and param.dim() <= 2:  # bias, b_in, b_out
        init.zeros_(param)
      else:
        init.normal_(param, mean=0.0, std=std)


class SparsetxModel(SparsetxPreTrainedModel):
  """Embedding, blocks and final norm: token ids [B,T] -> hidden states [B,T,D]."""

  def __init__(self, config: SparsetxConfig):
    super().__init__(config)
    cfg = config.sparsetx_model
    self.embed = Embed(cfg["vocab_size"], cfg["d_model"])
    self.layers = nn.ModuleList([SparsetxBlock(cfg, layer_ffn_config(cfg, i)) for i in range(cfg["n_layers"])])
    self.final_norm = Norm(cfg)
    self.post_init()

  def forward(self, input_ids, attention_mask=None, position_ids=None):
    """attention_mask [B,T] (1 = token, 0 = padding) hides padding keys; positions count real tokens from 0."""
    B, T = input_ids.shape
    causal_TS = torch.tril(torch.ones(T, T, dtype=torch.bool, device=input_ids.device))
    if attention_mask is None:
      mask_B1TS = causal_TS[None, None].expand(B, 1, T, T)
    else:
      mask_B1TS = (causal_TS[None] & attention_mask.bool()[:, None, :])[:, None]
    if position_ids is None:
      if attention_mask is None:
        position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
      else:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    x_BTD = self.embed.embedding[input_ids]
    for layer in self.layers:
      x_BTD = layer(x_BTD, position_ids, mask_B1TS)
    return self.final_norm(x_BTD)


class SparsetxForCausalLM(SparsetxPreTrainedModel, GenerationMixin):
  """Logits [B,T,V] float32: final-norm output (float32) @ embedding^T (tied) or @ lm_head.kernel."""

  def __init__(self, config: SparsetxConfig):
    super().__init__(config)
    cfg = config.sparsetx_model
    self.model = SparsetxModel(config)
    self.lm_head = None if cfg["tie_embeddings"] else Dense((cfg["d_model"],), (cfg["vocab_size"],), float32=True)
    self.post_init()

  @classmethod
  def _supports_default_dynamic_cache(cls) -> bool:
    return False  # no KV cache: each step recomputes the sequence

  def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
    return {"input_ids": input_ids, "attention_mask": attention_mask}

  def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None, **kwargs):
    hidden_BTD = self.model(input_ids, attention_mask, position_ids)
    if self.lm_head is None:
      logits_BTV = hidden_BTD @ self.model.embed.embedding.float().T
    else:
      logits_BTV = self.lm_head(hidden_BTD)
    loss = None
    if labels is not None:  # next-token loss; -100 marks ignored targets
      loss = F.cross_entropy(
        logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
      )
    return CausalLMOutput(loss=loss, logits=logits_BTV)


__all__ = ["SparsetxForCausalLM", "SparsetxModel", "SparsetxPreTrainedModel"]

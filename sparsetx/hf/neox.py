"""Dense GPT-NeoX-block models <-> Hugging Face `GPTNeoXForCausalLM` (config.json + tensors), exactly.

More: docs/modules.md, sparsetx/hf/neox.py.
"""

from collections.abc import Iterator

import ml_collections
import numpy as np
from flax import traverse_util

from sparsetx import config as config_lib
from sparsetx.hf import lazy_tensors

MODEL_TYPE = "gpt_neox"
ARCHITECTURE = "GPTNeoXForCausalLM"
SPARSETX_KEY = "sparsetx_model"  # the full sparsetx model config, for the fields HF has no name for
START_ID, EOS_ID, PAD_ID = 0, 1, 0  # seqio ids; a packed document starts with the shifted-in id 0
# Non-parameter buffers older GPT-NeoX checkpoints carry; they hold nothing the model needs.
IGNORED_SUFFIXES = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")
HEAD_ALIASES = {"lm_head.weight": "embed_out.weight"}  # transformers 5 saves the head as lm_head
HF_ACTIVATION = "gelu"  # transformers' ACT2FN["gelu"] is the exact erf GELU that sparsetx uses


def unsupported_reason(model: ml_collections.ConfigDict) -> str | None:
  """None when `model` (config.model) is exactly a GPTNeoXForCausalLM; otherwise why not."""
  if model.ffn.type != "mlp":
    return f"ffn.type={model.ffn.type!r} is not GPT-NeoX's dense GELU MLP (ffn.type='mlp')"
  if model.norm != "layernorm":
    return f"norm={model.norm!r}: GPT-NeoX uses LayerNorm with bias (norm='layernorm')"
  if not model.use_bias:
    return "use_bias=False: GPT-NeoX's attention and MLP projections carry biases (use_bias=True)"
  return None


def _require_supported(model: ml_collections.ConfigDict) -> None:
  reason = unsupported_reason(model)
  if reason:
    raise config_lib.ConfigError(f"this model cannot be exported as {ARCHITECTURE}: {reason}.")


def to_hf(model: ml_collections.ConfigDict, params) -> tuple[dict, dict[str, np.ndarray]]:
  """(config.json dict, {HF tensor name: float32 array}) of a sparsetx model and its params, all in memory."""
  config_json, tensors = hf_tensors(model)
  arrays = lazy_tensors.tree_reader(params)(list(lazy_tensors.tree_shapes(params)))
  return config_json, {name: lazy_tensors.made(tensor, arrays) for name, tensor in tensors.items()}


def _stack_qkv(xp, q_DHK, k_DHK, v_DHK):
  """(D, H, K) kernels -> (H, 3, K, D) -> (3D, D): output feature h*3K + j*K + k, j in (q, k, v)."""
  qkv_H3KD = xp.stack([x.transpose(1, 2, 0) for x in (q_DHK, k_DHK, v_DHK)], 1)
  return qkv_H3KD.reshape(-1, qkv_H3KD.shape[-1])


def hf_tensors(model: ml_collections.ConfigDict) -> tuple[dict, dict[str, lazy_tensors.HfTensor]]:
  """(config.json dict, {HF tensor name: how it is made from the params}) of a sparsetx model."""
  _require_supported(model)
  D, K = model.d_model, model.head_dim
  H = D // K
  config_json = dict(
    architectures=[ARCHITECTURE],
    model_type=MODEL_TYPE,
    vocab_size=model.vocab_size,
    hidden_size=D,
    num_hidden_layers=model.n_layers,
    num_attention_heads=H,
    intermediate_size=model.ffn.d_ffw,
    hidden_act=HF_ACTIVATION,
    max_position_embeddings=model.max_len,
    layer_norm_eps=model.norm_eps,
    use_parallel_residual=model.block == "parallel",
    attention_bias=True,
    tie_word_embeddings=bool(model.tie_embeddings),
    rope_parameters=dict(
      rope_type="default", rope_theta=float(model.rope_base), partial_rotary_factor=float(model.rotary_fraction)
    ),
    rotary_pct=float(model.rotary_fraction),  # the names transformers 4.x reads
    rotary_emb_base=float(model.rope_base),
    initializer_range=model.init_std,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    use_cache=True,
    bos_token_id=START_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
  )
  config_json[SPARSETX_KEY] = model.to_dict()

  same, transposed = lazy_tensors.HfTensor, lambda *path: lazy_tensors.HfTensor((path,), lambda xp, x: x.T)
  tensors = {"gpt_neox.embed_in.weight": same((("embed", "embedding"),))}
  for i in range(model.n_layers):
    layer, prefix = f"layers_{i}", f"gpt_neox.layers.{i}."
    for ours, theirs in (("attention_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
      tensors[prefix + theirs + ".weight"] = same(((layer, ours, "scale"),))
      tensors[prefix + theirs + ".bias"] = same(((layer, ours, "bias"),))
    qkv = [(layer, "attention", n) for n in ("query", "key", "value")]
    tensors[prefix + "attention.query_key_value.weight"] = same(tuple((*p, "kernel") for p in qkv), _stack_qkv)
    tensors[prefix + "attention.query_key_value.bias"] = same(
      tuple((*p, "bias") for p in qkv), lambda xp, *b_HK: xp.stack(b_HK, 1).reshape(-1)
    )
    tensors[prefix + "attention.dense.weight"] = same(
      ((layer, "attention", "out", "kernel"),), lambda xp, o_HKD: o_HKD.reshape(-1, o_HKD.shape[-1]).T
    )
    tensors[prefix + "attention.dense.bias"] = same(((layer, "attention", "out", "bias"),))
    tensors[prefix + "mlp.dense_h_to_4h.weight"] = transposed(layer, "mlp", "wi", "kernel")
    tensors[prefix + "mlp.dense_h_to_4h.bias"] = same(((layer, "mlp", "wi", "bias"),))
    tensors[prefix + "mlp.dense_4h_to_h.weight"] = transposed(layer, "mlp", "wo", "kernel")
    tensors[prefix + "mlp.dense_4h_to_h.bias"] = same(((layer, "mlp", "wo", "bias"),))
  tensors["gpt_neox.final_layer_norm.weight"] = same((("final_norm", "scale"),))
  tensors["gpt_neox.final_layer_norm.bias"] = same((("final_norm", "bias"),))
  if not model.tie_embeddings:
    tensors["embed_out.weight"] = transposed("lm_head", "kernel")
  return config_json, tensors


def _rope(config_json: dict) -> tuple[float, float]:
  """(rope_base, rotary_fraction) from transformers 5's rope_parameters or 4.x's flat names."""
  rope = config_json.get("rope_parameters") or config_json.get("rope_scaling") or {}
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind != "default":
    raise config_lib.ConfigError(
      f"config.json has rope_type={kind!r}; sparsetx implements the default rotary embedding only."
    )
  base = rope.get("rope_theta", config_json.get("rotary_emb_base", config_json.get("rope_theta", 10_000.0)))
  fraction = rope.get("partial_rotary_factor", config_json.get("rotary_pct", 0.25))
  return float(base), float(fraction)


def model_config(config_json: dict) -> ml_collections.ConfigDict:
  """The sparsetx model config of a GPT-NeoX config.json (refusing what sparsetx cannot compute)."""
  if config_json.get("model_type") != MODEL_TYPE:
    raise config_lib.ConfigError(
      f"config.json has model_type={config_json.get('model_type')!r}, not {MODEL_TYPE!r}; "
      "this reader converts GPT-NeoX directories only."
    )
  act = config_json.get("hidden_act", HF_ACTIVATION)
  if act != HF_ACTIVATION:
    raise config_lib.ConfigError(
      f"config.json has hidden_act={act!r}; sparsetx's MLP computes the exact GELU ({HF_ACTIVATION!r}) only."
    )
  if not config_json.get("attention_bias", True):
    raise config_lib.ConfigError(
      "config.json has attention_bias=false; sparsetx's dense model has biases on attention and MLP together."
    )
  model = config_lib.model_defaults()
  saved = config_json.get(SPARSETX_KEY)
  if isinstance(saved, dict):  # written by to_hf: restores the fields HF does not name (dtype, init, kernels)
    model.update(saved)
  hidden, heads = config_json["hidden_size"], config_json["num_attention_heads"]
  rope_base, rotary_fraction = _rope(config_json)
  model.update(
    vocab_size=config_json["vocab_size"],
    d_model=hidden,
    n_layers=config_json["num_hidden_layers"],
    head_dim=hidden // heads,
    max_len=config_json.get("max_position_embeddings", model.max_len),
    block="parallel" if config_json.get("use_parallel_residual", True) else "sequential",
    norm="layernorm",
    norm_eps=float(config_json.get("layer_norm_eps", 1e-5)),
    use_bias=True,
    rotary_fraction=rotary_fraction,
    rope_base=rope_base,
    tie_embeddings=bool(config_json.get("tie_word_embeddings", False)),
    init_std=float(config_json.get("initializer_range", model.init_std)),
  )
  model.ffn.update(type="mlp", d_ffw=config_json["intermediate_size"])
  if hidden % heads:
    raise config_lib.ConfigError(
      f"config.json has hidden_size={hidden} not divisible by num_attention_heads={heads}; the file is inconsistent."
    )
  config_lib.validate_model(model)
  return model


class _Tensors:
  """Takes tensors by name with shape checks, and reports what is missing or left over. `tensors` may be a dict or
  a lazy mapping (hf/weight_files.py) that reads each tensor when it is taken."""

  def __init__(self, tensors):
    self._tensors = tensors
    self._names = {HEAD_ALIASES.get(k, k): k for k in tensors if not k.endswith(IGNORED_SUFFIXES)}
    self._taken = set()

  def take(self, name: str, shape: tuple) -> np.ndarray:
    if name not in self._names:
      raise config_lib.ConfigError(
        f"the weights have no tensor {name!r}, which config.json's GPT-NeoX model needs; the directory is incomplete."
      )
    value = np.asarray(self._tensors[self._names[name]], dtype=np.float32)
    if value.shape != tuple(shape):
      raise config_lib.ConfigError(
        f"tensor {name!r} has shape {value.shape} but config.json implies {tuple(shape)}; "
        "the weights do not belong to this config.json."
      )
    self._taken.add(name)
    return value

  def check_all_taken(self, allowed: tuple = ()) -> None:
    left = sorted(set(self._names) - self._taken - set(allowed))
    if left:
      raise config_lib.ConfigError(
        f"the weights hold {len(left)} tensor(s) a GPT-NeoX model of this config.json does not have "
        f"(first: {left[0]!r}); the weights do not belong to this config.json."
      )


def from_hf(config_json: dict, tensors) -> tuple[ml_collections.ConfigDict, dict]:
  """(sparsetx model config, flax params as float32 numpy) of a GPT-NeoX config.json and its tensors."""
  model = model_config(config_json)
  return model, traverse_util.unflatten_dict(dict(param_parts(model, tensors)))


def param_parts(model: ml_collections.ConfigDict, tensors) -> Iterator[tuple[lazy_tensors.Path, dict]]:
  """The params of `model` as (path, subtree) parts, each made when reached from the tensors it needs (the
  embedding, each layer, the final norm, the head), so a reader of a lazy `tensors` holds one part at a time."""
  D, K, V, F = model.d_model, model.head_dim, model.vocab_size, model.ffn.d_ffw
  H = D // K
  source = _Tensors(tensors)
  yield ("embed",), {"embedding": source.take("gpt_neox.embed_in.weight", (V, D))}
  for i in range(model.n_layers):
    prefix, layer = f"gpt_neox.layers.{i}.", {}
    for ours, theirs in (("attention_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
      layer[ours] = {
        "scale": source.take(prefix + theirs + ".weight", (D,)),
        "bias": source.take(prefix + theirs + ".bias", (D,)),
      }
    qkv_H3KD = source.take(prefix + "attention.query_key_value.weight", (3 * D, D)).reshape(H, 3, K, D)
    qkv_H3K = source.take(prefix + "attention.query_key_value.bias", (3 * D,)).reshape(H, 3, K)
    attention = {
      name: {
        "kernel": np.ascontiguousarray(np.transpose(qkv_H3KD[:, j], (2, 0, 1))),
        "bias": np.ascontiguousarray(qkv_H3K[:, j]),
      }
      for j, name in enumerate(("query", "key", "value"))
    }
    del qkv_H3KD
    attention["out"] = {
      "kernel": np.ascontiguousarray(source.take(prefix + "attention.dense.weight", (D, D)).T).reshape(H, K, D),
      "bias": source.take(prefix + "attention.dense.bias", (D,)),
    }
    layer["attention"] = attention
    layer["mlp"] = {
      "wi": {
        "kernel": np.ascontiguousarray(source.take(prefix + "mlp.dense_h_to_4h.weight", (F, D)).T),
        "bias": source.take(prefix + "mlp.dense_h_to_4h.bias", (F,)),
      },
      "wo": {
        "kernel": np.ascontiguousarray(source.take(prefix + "mlp.dense_4h_to_h.weight", (D, F)).T),
        "bias": source.take(prefix + "mlp.dense_4h_to_h.bias", (D,)),
      },
    }
    yield (f"layers_{i}",), layer
    del layer, attention  # before the next layer is read (see custom.param_parts)
  yield (
    ("final_norm",),
    {
      "scale": source.take("gpt_neox.final_layer_norm.weight", (D,)),
      "bias": source.take("gpt_neox.final_layer_norm.bias", (D,)),
    },
  )
  if model.tie_embeddings:
    source.check_all_taken(allowed=("embed_out.weight",))  # some writers store the tied copy too
  else:
    head = np.ascontiguousarray(source.take("embed_out.weight", (V, D)).T)
    source.check_all_taken()
    yield ("lm_head",), {"kernel": head}

"""Attention implementations (sparsetx/models/attention.py): causal within packed documents, the same values and
gradients as the XLA reference (splash and the Pallas GPU kernel in interpret mode on CPU), decoding unchanged,
and the fused calls in the programs lowered for GPU (cuDNN, Triton) and TPU (splash's Mosaic call)."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import load_config

from sparsetx import config as config_lib
from sparsetx.interp.trace import StandardizedTransformer
from sparsetx.models import attention as attention_lib
from sparsetx.models.transformer import Transformer, init_cache
from sparsetx.train import loss as loss_lib

EPS32 = float(jnp.finfo(jnp.float32).eps)
EPS_BF16 = float(jnp.finfo(jnp.bfloat16).eps)


def packed_segments(B: int, T: int):
  """[B,T] segment ids: row 0 three documents and a padding tail (id 0), row 1 one document."""
  row0 = np.concatenate([np.full(11, 1), np.full(17, 2), np.full(T - 33, 3), np.zeros(5)])
  return jnp.asarray(np.stack([row0] + [np.ones(T)] * (B - 1)), jnp.int32)


def qkv(B=2, T=40, H=2, K=64, dtype=jnp.float32, seed=0):
  return tuple(
    jax.random.normal(k, (B, T, H, K), jnp.float32).astype(dtype) for k in jax.random.split(jax.random.key(seed), 3)
  )


def reference_attention(q_BTHK, k_BTHK, v_BTHK, segment_ids_BT):
  """float64, one query at a time: softmax(q.k / sqrt(K)) over the keys s <= t of the query's own document."""
  q, k, v, seg = (np.asarray(a, np.float64) for a in (q_BTHK, k_BTHK, v_BTHK, segment_ids_BT))
  B, T, H, K = q.shape
  out = np.zeros_like(q)
  for b in range(B):
    for t in range(T):
      keys = [s for s in range(t + 1) if seg[b, s] == seg[b, t]]
      logits_HS = np.einsum("hk,shk->hs", q[b, t], k[b, keys]) / np.sqrt(K)
      p_HS = np.exp(logits_HS - logits_HS.max(-1, keepdims=True))
      out[b, t] = np.einsum("hs,shk->hk", p_HS / p_HS.sum(-1, keepdims=True), v[b, keys])
  return out


def xla(q, k, v, segment_ids):
  return attention_lib.xla_attention(q, k, v, attention_lib.causal_segment_mask(segment_ids))


def test_xla_attention_is_causal_softmax_within_documents():
  q, k, v = qkv()
  segments = packed_segments(2, 40)
  # Summation-order rounding of float32 dots over K = 64 and sums over <= 40 keys: a few hundred eps of |v|.
  np.testing.assert_allclose(
    xla(q, k, v, segments), reference_attention(q, k, v, segments), atol=256 * EPS32 * float(jnp.abs(v).max()), rtol=0
  )


FUSED_ON_CPU = [("splash", attention_lib.splash_attention)]


@pytest.mark.parametrize("name, kernel", FUSED_ON_CPU)
def test_fused_kernel_values_and_gradients_equal_xla(name, kernel):
  """float32, a length that is no whole number of blocks (padded inside), three documents and a padding tail."""
  q, k, v = qkv()
  segments = packed_segments(2, 40)
  cotangent = jax.random.normal(jax.random.key(9), q.shape)
  loss = lambda f: jax.jit(
    jax.value_and_grad(  # noqa: E731
      lambda q, k, v: jnp.vdot(f(q, k, v, segments), cotangent), argnums=(0, 1, 2)
    )
  )
  fused = lambda q, k, v, s: kernel(q, k, v, s, interpret=True)  # noqa: E731
  out_fused, out_xla = jax.jit(fused)(q, k, v, segments), jax.jit(xla)(q, k, v, segments)
  (_, grads_fused), (_, grads_xla) = loss(fused)(q, k, v), loss(xla)(q, k, v)
  # Both accumulate in float32 in different orders (blocked online softmax vs one pass) over <= 128 padded keys:
  # each output is within 128 eps of the largest term it sums.
  np.testing.assert_allclose(out_fused, out_xla, atol=128 * EPS32 * float(jnp.abs(v).max()), rtol=0)
  for g_fused, g_xla in zip(grads_fused, grads_xla):
    np.testing.assert_allclose(g_fused, g_xla, atol=128 * EPS32 * float(jnp.abs(g_xla).max()), rtol=0)
  assert not np.allclose(out_xla[0, 11:28], xla(q, k, v, jnp.ones_like(segments))[0, 11:28])  # documents matter


@pytest.mark.parametrize("name, kernel", FUSED_ON_CPU)
def test_fused_kernel_in_bfloat16_is_within_bfloat16_rounding(name, kernel):
  """Each path rounds at most probabilities, products and the output to bf16 (relative 2^-8 each), and an
  output is a convex combination of value rows: the two differ by at most 4 * 2^-8 * max|v|."""
  q, k, v = qkv(T=128, dtype=jnp.bfloat16, seed=1)
  segments = packed_segments(2, 128)
  out_fused = jax.jit(lambda *a: kernel(*a, interpret=True))(q, k, v, segments)
  assert out_fused.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(out_fused, np.float32),
    np.asarray(jax.jit(xla)(q, k, v, segments), np.float32),
    atol=4 * EPS_BF16 * float(jnp.abs(v.astype(jnp.float32)).max()),
    rtol=0,
  )


@pytest.mark.parametrize("attention", ["splash"])
def test_fused_kernel_on_a_mesh_runs_per_shard_and_equals_xla(attention):
  """Rows over data (4), heads over tensor (2): each device runs the kernel on its own rows and heads."""
  from sparsetx.parallel import logical_rules
  from sparsetx.parallel import mesh as mesh_lib

  config = config_lib.default_config().mesh
  config.ici.update(data=4, fsdp=1, tensor=2, expert=1)
  mesh = mesh_lib.make_mesh(config)
  q, k, v = qkv(B=4, T=40, H=2)
  segments = jnp.concatenate([packed_segments(2, 40)] * 2)
  with logical_rules.activate(mesh, config_lib.DEFAULT_RULES):
    fused = jax.jit(lambda *a: attention_lib.fused_attention(attention, *a))
    assert "shard_map" in str(jax.make_jaxpr(fused)(q, k, v, segments))
    out = fused(q, k, v, segments)
  np.testing.assert_allclose(out, jax.jit(xla)(q, k, v, segments), atol=128 * EPS32 * float(jnp.abs(v).max()), rtol=0)


def model_config(attention: str, **model) -> ml_collections.FrozenConfigDict:
  config = load_config("configs/tiny.py", "mlp")
  config.model.update(dict(n_layers=1, dtype="float32", max_len=48, attention=attention), **model)
  config.data.seq_len = 48
  config_lib.validate(config)
  return ml_collections.FrozenConfigDict(config.model)


def packed_batch(T=40):
  tokens = jax.random.randint(jax.random.key(3), (2, T), 0, 259)
  segments = packed_segments(2, T)
  starts = np.asarray(segments)[:, 1:] != np.asarray(segments)[:, :-1]
  positions = np.zeros((2, T), np.int32)
  for b in range(2):
    for t in range(1, T):
      positions[b, t] = 0 if starts[b, t - 1] else positions[b, t - 1] + 1
  return tokens, jnp.asarray(positions), segments


@pytest.mark.parametrize("attention", ["splash"])
def test_model_with_fused_attention_matches_xla_and_runs_the_kernel(attention):
  tokens, positions, segments = packed_batch()
  fused, reference = Transformer(model_config(attention)), Transformer(model_config("xla"))
  variables = jax.jit(reference.init)(jax.random.key(0), tokens)

  def loss(model):
    return jax.jit(jax.value_and_grad(lambda v: model.apply(v, tokens, positions, segments).mean()))

  (value_fused, grads_fused), (value_xla, grads_xla) = loss(fused)(variables), loss(reference)(variables)
  # One layer of float32 attention (as in the kernel test) under the same float32 projections and head.
  np.testing.assert_allclose(value_fused, value_xla, rtol=1e-6)
  for g_fused, g_xla in zip(jax.tree.leaves(grads_fused), jax.tree.leaves(grads_xla)):
    np.testing.assert_allclose(g_fused, g_xla, atol=128 * EPS32 * float(jnp.abs(g_xla).max()), rtol=0)
  # The train step's loss (which records intermediates for the sparse-layer stats) runs the kernel.
  batch = dict(inputs=tokens, targets=tokens, positions=positions, segment_ids=segments)
  losses = lambda model: str(
    jax.make_jaxpr(  # noqa: E731
      lambda p: loss_lib.token_losses(model, p, batch, 0.0)
    )(variables["params"])
  )
  assert "pallas_call" in losses(fused) and "pallas_call" not in losses(reference)
  # The fused kernels form no pattern to tap; the interp tools' model (with_xla_attention) does.
  _, state = fused.apply(variables, tokens, positions, segments, mutable=["intermediates"])
  assert "attention_probabilities" not in state["intermediates"]["layers_0"].get("attention", {})
  traced = StandardizedTransformer(fused.cfg, variables["params"])
  _, state = traced.model.apply(variables, tokens, positions, segments, mutable=["intermediates"])
  probs_BHTS = state["intermediates"]["layers_0"]["attention"]["attention_probabilities"][0]
  assert probs_BHTS.shape[2:] == (40, 40) and float(probs_BHTS[0, :, 12, :11].max()) == 0.0  # doc 2 skips doc 1


def test_decoding_with_a_fused_attention_config_equals_the_full_forward():
  """Decode calls use the XLA path over the cache; their logits equal the fused kernel's full forward."""
  model = Transformer(model_config("splash"))
  tokens = jax.random.randint(jax.random.key(4), (1, 24), 0, 259)
  variables = jax.jit(model.init)(jax.random.key(0), tokens)
  full = jax.jit(model.apply)(variables, tokens)
  step = jax.jit(lambda v, cache, t: model.apply({**v, "cache": cache}, t, decode=True, mutable=["cache"]))
  prefill, state = step(variables, init_cache(model, 1), tokens[:, :20])
  logits = [prefill]
  for t in range(20, 24):
    out, state = step(variables, state["cache"], tokens[:, t : t + 1])
    logits.append(out)
  np.testing.assert_allclose(jnp.concatenate(logits, axis=1), full, atol=1e-5, rtol=1e-5)


def test_auto_picks_cudnn_on_gpu_splash_on_tpu_xla_on_cpu():
  """By the device the program is for (a topology's, kernels/platform.target)."""
  from sparsetx.measure import aot

  assert attention_lib.resolve("auto", jnp.bfloat16) == "xla"
  with aot.on_topology("h100:1x1x1"):
    assert attention_lib.resolve("auto", jnp.bfloat16) == "cudnn"
    assert attention_lib.resolve("auto", jnp.float32) == "xla"  # cuDNN has no float32 kernel
  with aot.on_topology("v5p:2x2x1"):
    assert attention_lib.resolve("auto", jnp.float32) == "splash"


@pytest.mark.parametrize(
  "update, message",
  [
    (dict(attention="flash"), r"config\.model\.attention='flash' is unknown; use one of 'auto', 'xla'"),
    (
      dict(attention="cudnn", dtype="float32"),
      r"config\.model\.attention='cudnn' has no float32 kernel; set config\.model\.dtype",
    ),
    (dict(attention="cudnn", head_dim=36, d_model=144), r"head_dim that is a multiple of 8"),
  ],
)
def test_bad_attention_config_is_one_clear_error(update, message):
  config = load_config("configs/tiny.py", "mlp")
  config.model.update(update)
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(config)


def test_cudnn_off_gpu_is_one_clear_error():
  q, k, v = qkv(dtype=jnp.bfloat16)
  with pytest.raises(config_lib.ConfigError, match=r"attention='cudnn' runs on NVIDIA GPUs only.*use 'auto'"):
    attention_lib.fused_attention("cudnn", q, k, v, packed_segments(2, 40))


# ------------------------------------------------------------------------------------- lowering for the accelerators


def logits_shape() -> str:
  """The [B,H,T,T] float32 logits the XLA path materializes in the lowered model (B = 2, T = 256)."""
  config = model_config("xla")
  return f"tensor<2x{config.d_model // config.head_dim}x256x256xf32>"


TOPOLOGIES = {"cuda": "h100:1x1x1", "tpu": "v5p:2x2x1"}


def lowered_train_grads(platform: str, attention: str) -> str:
  """StableHLO of the loss gradients of a bf16 model at T = 256, lowered for one H100 or v5p on this CPU machine."""
  from sparsetx.measure import aot

  model = Transformer(model_config(attention, dtype="bfloat16", max_len=256))
  tokens = jax.ShapeDtypeStruct((2, 256), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
  loss = lambda v, t, s: model.apply(v, t, None, s).mean()  # noqa: E731
  with aot.on_topology(TOPOLOGIES[platform]):
    return jax.jit(jax.grad(loss)).trace(variables, tokens, tokens).lower().as_text()


def test_cuda_lowering_runs_cudnn_flash_attention_forward_and_backward(monkeypatch):
  assert logits_shape() in lowered_train_grads("cuda", "xla")  # the reference materializes them
  text = lowered_train_grads("cuda", "auto")
  calls = set(re.findall(r"__cudnn\$fmha\w+", text))
  assert calls == {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"}, calls
  assert logits_shape() not in text  # cuDNN does not


def test_the_retired_pallas_attention_names_its_replacement():
  """JAX deprecated its Pallas GPU attention: a config naming it is one line naming cuDNN's; a saved one reads as auto."""
  from sparsetx.train.checkpoints import checkpointing

  config = load_config("configs/tiny.py", "mlp")
  config.model.attention = "pallas"
  with pytest.raises(config_lib.ConfigError, match=r"config.model.attention='pallas' is retired .* use 'cudnn'"):
    config_lib.validate(config)
  saved = config_lib.default_config().to_dict()
  saved["model"]["attention"] = "pallas"
  assert checkpointing.config_from_saved(saved).model.attention == "auto"


def test_tpu_lowering_runs_splash_attention_forward_and_backward(monkeypatch):
  text = lowered_train_grads("tpu", "auto")
  assert text.count("tpu_custom_call") >= 3  # forward, dq and dkv kernels
  assert "splash_mha_fwd" in text and "splash_mha_dq" in text and "splash_mha_dkv" in text
  assert logits_shape() not in text


@pytest.mark.parametrize(
  "platform, calls",
  [
    ("cuda", {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"}),
    (
      "tpu",
      {
        "splash_mha_fwd_segmented_residuals",
        "splash_mha_dq_segmented_no_residuals",
        "splash_mha_dkv_segmented_no_residuals",
      },
    ),
  ],
)
def test_train_step_lowers_with_the_fused_attention_by_default(platform, calls):
  """The whole train step (bf16, attention=auto) lowered as the trainer jits it: the fused calls, no XLA logits."""
  from sparsetx.measure import aot
  from sparsetx.perf import hlo_text

  config = load_config("configs/tiny.py", "mlp")
  config.model.update(max_len=256, n_layers=2)
  config.data.update(seq_len=256, global_batch_size=2)
  config_lib.validate(config)
  text = aot.lower_train_step(config, TOPOLOGIES[platform])
  assert calls <= {name or target for target, name in hlo_text.custom_calls(text)}
  assert logits_shape() not in text


@pytest.mark.parametrize("ici", [dict(data=8), dict(data=4, tensor=2)])
def test_splash_train_step_lowers_on_a_tpu_mesh(ici):
  """On a mesh splash runs in a shard_map over every free axis (Pallas TPU refuses a partially manual region)."""
  from sparsetx.measure import aot
  from sparsetx.perf import hlo_text

  config = load_config("configs/tiny.py", "mlp")
  config.model.update(max_len=256, n_layers=1)
  config.data.update(seq_len=256, global_batch_size=8, eval_batch_size=8)
  config.mesh.ici.update(data=1, fsdp=1, tensor=1, expert=1)
  config.mesh.ici.update(**ici)
  config_lib.validate(config)
  text = aot.lower_train_step(config, "v5p:2x2x2", 8)
  names = {name for _, name in hlo_text.custom_calls(text)}
  assert {"splash_mha_fwd_segmented_residuals", "splash_mha_dkv_segmented_no_residuals"} <= names

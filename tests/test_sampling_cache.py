"""The decode path with a KV cache: prefill + one-token steps give the full forward's logits at every
position (both block kinds, dense and sparse feed-forward layers); the cached sampler generates what the
recompute sampler does; calls that do not fit the cache are refused in one sentence."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from test_train import micro_config

from sparsetx import config as config_lib
from sparsetx.evaluate import sampling
from sparsetx.models.transformer import Transformer, init_cache

PROMPT_LEN, TOTAL_LEN = 5, 14


def micro_model(ffn_type: str, block: str = "sequential", ffn_layers: str = "") -> Transformer:
  """micro_config's model (d_model 64, 2 layers, window 32, f32) with the block kind under test; ffn_layers "1":
  layer 0 keeps a dense MLP (mixed models), so one model covers the MLP and a sparse layer."""
  config = micro_config(ffn_type)
  config.model.update(block=block, norm="rmsnorm" if block == "sequential" else "layernorm", ffn_layers=ffn_layers)
  config_lib.validate(config)
  return Transformer(ml_collections.FrozenConfigDict(config.model))


def params_and_full_logits(model, tokens_BT):
  """The model's params and its training forward's logits on tokens_BT (one compiled program)."""
  logits_BTV, variables = jax.jit(model.init_with_output)(jax.random.key(0), tokens_BT)
  return nn.unbox(variables)["params"], np.asarray(logits_BTV)


def decode_step(model):
  return jax.jit(
    lambda params, cache, tokens_BT, positions_BT: model.apply(
      {"params": params, "cache": cache}, tokens_BT, positions_BT, decode=True, mutable=["cache"]
    )
  )


@pytest.mark.parametrize(
  "ffn_type,block", [(f, b) for f in ("sgatlin", "fff") for b in ("sequential", "parallel")] + [("moe", "sequential")]
)
def test_prefill_and_steps_give_the_full_forward_logits(ffn_type, block):
  """Rows of different prompt lengths, as the sampler runs them: a padded prefill, then each row's next
  token at its own position; the logits of every real token equal the full forward's. Layer 0 is an MLP."""
  model = micro_model(ffn_type, block, ffn_layers="1")
  tokens_BT = jax.random.randint(jax.random.key(1), (2, TOTAL_LEN), 2, 259)
  params, full_BTV = params_and_full_logits(model, tokens_BT)

  lengths_B = np.array([PROMPT_LEN, PROMPT_LEN - 2])
  prefill_BT = np.where(np.arange(PROMPT_LEN) < lengths_B[:, None], tokens_BT[:, :PROMPT_LEN], 0)
  step = decode_step(model)
  logits_BPV, variables = step(params, init_cache(model, 2), prefill_BT, None)
  got = [[logits_BPV[b, t] for t in range(lengths_B[b])] for b in range(2)]
  while (lengths_B < TOTAL_LEN).any():
    positions_B1 = np.minimum(lengths_B, TOTAL_LEN - 1)[:, None]  # a finished row repeats its last token
    logits_B1V, variables = step(
      params, variables["cache"], np.take_along_axis(tokens_BT, positions_B1, 1), positions_B1
    )
    for b in np.flatnonzero(lengths_B < TOTAL_LEN):
      got[b].append(logits_B1V[b, 0])
    lengths_B = np.minimum(lengths_B + 1, TOTAL_LEN)
  assert variables["cache"]["cache_index"].tolist() == [TOTAL_LEN, TOTAL_LEN]
  np.testing.assert_allclose(np.stack([np.stack(row) for row in got]), full_BTV, rtol=1e-5, atol=1e-5)


def test_positions_default_to_the_cache_index():
  """Without positions, a decode call continues where the cache stands: prefill then steps == full forward."""
  model = micro_model("mlp")
  tokens_BT = jax.random.randint(jax.random.key(2), (2, 9), 2, 259)
  params, full_BTV = params_and_full_logits(model, tokens_BT)
  apply = jax.jit(
    lambda cache, tokens: model.apply({"params": params, "cache": cache}, tokens, decode=True, mutable=["cache"])
  )
  logits, variables = apply(init_cache(model, 2), tokens_BT[:, :6])
  pieces = [logits]
  for t in range(6, 9):
    logits, variables = apply(variables["cache"], tokens_BT[:, t : t + 1])
    pieces.append(logits)
  np.testing.assert_allclose(np.concatenate(pieces, 1), full_BTV, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ffn_type,block", [("sgatlin", "sequential"), ("mlp", "parallel")])
def test_cached_sampler_generates_what_recomputing_does(ffn_type, block):
  model = micro_model(ffn_type, block)
  params, _ = params_and_full_logits(model, jnp.zeros((1, 8), jnp.int32))
  prompts = [[0, 5, 9, 13, 200], [0, 7], [0, 3, 3, 3, 3, 3, 3, 3, 40, 41, 42]]
  cached = sampling.Sampler(model, params, 32, batch_size=4, eos_id=1)
  recompute = sampling.Sampler(model, params, 32, batch_size=4, eos_id=1, kv_cache=False)
  greedy = cached.generate(prompts, max_new_tokens=12)
  assert [len(new) for new in greedy] == [12, 12, 12]
  assert greedy == recompute.generate(prompts, max_new_tokens=12)
  # The same draws: step s uses fold_in(key, s) on both paths (top_k 0: the greedy runs' compiled programs).
  sampled = cached.generate(prompts, max_new_tokens=12, temperature=1.0, seed=3)
  assert sampled == recompute.generate(prompts, max_new_tokens=12, temperature=1.0, seed=3)
  assert sampled != greedy


def test_calls_that_do_not_fit_the_cache_are_refused():
  model = micro_model("mlp")
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]  # shapes suffice
  cache = init_cache(model, 1)
  with pytest.raises(
    config_lib.ConfigError,
    match=r"decode call of 33 tokens does not fit the cache of "
    r"config.model.max_len=32 positions; shorten the prompt",
  ):
    model.apply({"params": params, "cache": cache}, jnp.zeros((1, 33), jnp.int32), decode=True, mutable=["cache"])
  with pytest.raises(config_lib.ConfigError, match="decode=True takes one sequence per row; drop segment_ids"):
    model.apply(
      {"params": params, "cache": cache},
      jnp.zeros((1, 4), jnp.int32),
      None,
      jnp.ones((1, 4), jnp.int32),
      decode=True,
      mutable=["cache"],
    )
  with pytest.raises(
    config_lib.ConfigError,
    match=r"sampler's max_len=64 exceeds the model's decode cache of "
    r"config.model.max_len=32 positions; pass max_len=32",
  ):
    sampling.Sampler(model, params, 64)


def test_prefill_length_rounds_up_to_a_power_of_two_within_the_window():
  assert [sampling.prefill_length(n, 32) for n in (1, 2, 3, 5, 16, 17, 31)] == [1, 2, 4, 8, 16, 32, 32]

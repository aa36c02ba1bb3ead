"""Text generation: greedy, temperature and top-k sampling, as one jitted program per batch of prompts.

With the KV cache (the default), the prompts are prefilled in one decode call of the model
(sparsetx.models.transformer: each attention layer stores its keys/values) and every new token is one
decode step of [batch, 1] tokens that reads the cache: a step costs a forward of one token per row, not of
the whole window. `kv_cache=False` recomputes the whole buffer ([batch, max_len]) every step and reads
the logits at each row's last token: the training forward itself, kept as the reference the cached path
is tested against and the baseline a speed comparison needs.

More: docs/modules.md, sparsetx/evaluate/sampling.py.
"""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparsetx import config as config_lib
from sparsetx.models.transformer import init_cache


def choose_next(logits_BV, temperature, top_k: int, key):
  """Greedy when temperature == 0, else a sample from softmax(logits / temperature) over the top k."""
  logits_BV = logits_BV.astype(jnp.float32)
  greedy_B = jnp.argmax(logits_BV, axis=-1)
  if top_k:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  sampled_B = jax.random.categorical(key, logits_BV / jnp.maximum(temperature, 1e-6), axis=-1)
  return jnp.where(temperature > 0, sampled_B, greedy_B).astype(jnp.int32)


def _append(tokens_BT, lengths_B, done_B, next_B, eos_id):
  """Each unfinished row's next token written at its length (finished rows unchanged); done once it is eos_id."""
  rows_B, T = jnp.arange(tokens_BT.shape[0]), tokens_BT.shape[1]
  write_B = jnp.where(done_B, tokens_BT[rows_B, jnp.minimum(lengths_B, T - 1)], next_B)
  tokens_BT = tokens_BT.at[rows_B, lengths_B].set(write_B, mode="drop")
  return tokens_BT, jnp.where(done_B, lengths_B, lengths_B + 1), done_B | (next_B == eos_id)


def _keep_going(max_new_tokens):
  """while_loop condition over a (step, tokens, lengths, done, ...) carry: more to generate and a row not done."""
  return lambda carry: (carry[0] < max_new_tokens) & ~jnp.all(carry[3])


def _generate_recompute(model, top_k, params, tokens_BT, lengths_B, done_B, max_new_tokens, temperature, eos_id, key):
  B, T = tokens_BT.shape
  positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
  segment_ids_BT = jnp.ones((B, T), jnp.int32)
  rows_B = jnp.arange(B)

  def one_token(carry):
    step, tokens_BT, lengths_B, done_B = carry
    logits_BTV = model.apply({"params": params}, tokens_BT, positions_BT, segment_ids_BT)
    last_BV = logits_BTV[rows_B, lengths_B - 1]
    next_B = choose_next(last_BV, temperature, top_k, jax.random.fold_in(key, step))
    tokens_BT, lengths_B, done_B = _append(tokens_BT, lengths_B, done_B, next_B, eos_id)
    return step + 1, tokens_BT, lengths_B, done_B

  _, tokens_BT, lengths_B, _ = jax.lax.while_loop(
    _keep_going(max_new_tokens), one_token, (0, tokens_BT, lengths_B, done_B)
  )
  return tokens_BT, lengths_B


def generate_cached(
  model, top_k, prefill_len, params, tokens_BT, lengths_B, done_B, max_new_tokens, temperature, eos_id, key
):
  """_generate_recompute's tokens from a prefill of tokens_BT[:, :prefill_len] and one decode step per new token."""
  B = tokens_BT.shape[0]
  rows_B = jnp.arange(B)

  def decode(cache, tokens_BS, positions_BS=None):
    logits_BSV, variables = model.apply(
      {"params": params, "cache": cache}, tokens_BS, positions_BS, decode=True, mutable=["cache"]
    )
    return logits_BSV, variables["cache"]

  logits_BPV, cache = decode(init_cache(model, B), tokens_BT[:, :prefill_len])
  last_BV = logits_BPV[rows_B, lengths_B - 1]

  def one_token(carry):
    step, tokens_BT, lengths_B, done_B, cache, last_BV = carry
    next_B = choose_next(last_BV, temperature, top_k, jax.random.fold_in(key, step))
    tokens_BT, lengths_B, done_B = _append(tokens_BT, lengths_B, done_B, next_B, eos_id)
    # Each row's newest token (a finished row's last one again: same slot, same values) at its position.
    newest_B1 = (lengths_B - 1)[:, None]
    logits_B1V, cache = decode(cache, jnp.take_along_axis(tokens_BT, newest_B1, 1), newest_B1)
    return step + 1, tokens_BT, lengths_B, done_B, cache, logits_B1V[:, 0]

  carry = (0, tokens_BT, lengths_B, done_B, cache, last_BV)
  _, tokens_BT, lengths_B, _, _, _ = jax.lax.while_loop(_keep_going(max_new_tokens), one_token, carry)
  return tokens_BT, lengths_B


def prefill_length(longest_prompt: int, max_len: int) -> int:
  """The prefill's token count: the longest prompt rounded up to a power of two, at most max_len."""
  return min(max_len, 1 << max(0, longest_prompt - 1).bit_length())


class Sampler:
  """Generates continuations of token-id prompts with one model; `max_len` is the model's window.

  kv_cache=False recomputes the whole window per token (the reference; see the module docstring).
  """

  def __init__(self, model, params, max_len: int, batch_size: int = 8, eos_id: int = 1, kv_cache: bool = True):
    if kv_cache and max_len > model.cfg.max_len:
      raise config_lib.ConfigError(
        f"the sampler's max_len={max_len} exceeds the model's decode cache of config.model.max_len="
        f"{model.cfg.max_len} positions; pass max_len={model.cfg.max_len}."
      )
    self.params, self.max_len, self.batch_size, self.eos_id = params, max_len, batch_size, eos_id
    self.kv_cache = kv_cache
    if kv_cache:
      self._generate = jax.jit(functools.partial(generate_cached, model), static_argnums=(0, 1))
    else:
      self._generate = jax.jit(functools.partial(_generate_recompute, model), static_argnums=0)

  def generate(
    self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, seed: int = 0
  ) -> list[list[int]]:
    """The new tokens of each prompt, up to `max_new_tokens`, ending before the first eos_id."""
    if not 0 < max_new_tokens < self.max_len:
      raise config_lib.ConfigError(
        f"max_new_tokens={max_new_tokens} must be between 1 and {self.max_len - 1} (the model's window of "
        f"{self.max_len} tokens holds the prompt and the new tokens); lower it."
      )
    if temperature < 0 or top_k < 0:
      raise config_lib.ConfigError(f"temperature={temperature} and top_k={top_k} must be >= 0 (0: greedy / no top-k).")
    if any(len(prompt) == 0 for prompt in prompts):
      raise config_lib.ConfigError("a prompt has no tokens; start it with the start token (id 0).")
    keep = self.max_len - max_new_tokens
    prompts = [list(prompt)[-keep:] for prompt in prompts]
    B, T = self.batch_size, self.max_len
    key = jax.random.key(seed)
    out = []
    for start in range(0, len(prompts), B):
      chunk = prompts[start : start + B]
      tokens_BT, lengths_B, done_B = np.zeros((B, T), np.int32), np.ones(B, np.int32), np.ones(B, bool)
      for b, prompt in enumerate(chunk):
        tokens_BT[b, : len(prompt)], lengths_B[b], done_B[b] = prompt, len(prompt), False
      static = (int(top_k), prefill_length(max(map(len, chunk)), T)) if self.kv_cache else (int(top_k),)
      tokens_BT, new_lengths_B = jax.device_get(
        self._generate(
          *static,
          self.params,
          tokens_BT,
          lengths_B,
          done_B,
          np.int32(max_new_tokens),
          np.float32(temperature),
          np.int32(self.eos_id),
          jax.random.fold_in(key, start),
        )
      )
      for b, prompt in enumerate(chunk):
        new = tokens_BT[b, len(prompt) : new_lengths_B[b]].tolist()
        out.append(new[: new.index(self.eos_id)] if self.eos_id in new else new)
    return out

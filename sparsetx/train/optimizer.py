"""AdamW with the sgatlin paper's warmup-stable-decay schedule (or cosine), clipping and a decay mask."""

import jax
import jax.numpy as jnp
import ml_collections
import optax

NO_DECAY_NAMES = ("bias", "scale", "b_in", "b_out")  # biases and norm scales


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
  """wsd: linear warmup from 0, constant peak, then 1 - sqrt decay to 0 over the last decay_fraction."""
  peak, total, warmup = train.learning_rate, train.steps, min(train.warmup_steps, train.steps)
  if train.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total, warmup + 1), end_value=0.0)
  decay = max(1, int(round(train.decay_fraction * total))) if train.decay_fraction > 0 else 0
  stable = max(0, total - warmup - decay)

  def sqrt_decay(step):
    return peak * (1.0 - jnp.sqrt(jnp.minimum(step, decay) / decay))

  schedules = [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)]
  boundaries = [warmup]
  if decay:
    schedules.append(sqrt_decay)
    boundaries.append(warmup + stable)
  return optax.join_schedules(schedules, boundaries)


def decay_mask(params, decay_norms_and_biases: bool):
  """True where weight decay applies: never scalars; norms and biases only when asked."""

  def decays(path, leaf):
    if jnp.ndim(leaf) == 0:
      return False
    name = getattr(path[-1], "key", str(path[-1]))
    return decay_norms_and_biases or name not in NO_DECAY_NAMES

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(train.clip_norm),
      optax.adamw(
          learning_rate_schedule(train),
          b1=train.b1,
          b2=train.b2,
          eps=train.eps,
          weight_decay=train.weight_decay,
          mask=lambda params: decay_mask(params, train.decay_norms_and_biases),
      ),
  )

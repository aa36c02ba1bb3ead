"""AdamW with the sgatlin paper's warmup-stable-decay schedule (or cosine), clipping and a decay mask."""

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax.core import meta as flax_meta

from sparsetx import config as config_lib

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


def _adamw(train: ml_collections.ConfigDict, schedule: optax.Schedule) -> optax.GradientTransformation:
  return optax.adamw(
    schedule,
    b1=train.b1,
    b2=train.b2,
    eps=train.eps,
    weight_decay=train.weight_decay,
    mask=lambda params: decay_mask(params, train.decay_norms_and_biases),
  )


def freeze_labels(params, model: ml_collections.ConfigDict):
  """'new' on the feed-forward subtrees of the swapped layers (config.model.ffn_layers, every layer when empty),
  'copied' elsewhere: derivable from the config alone, so a resumed run rebuilds the same groups."""
  new_layers = {f"layers_{i}" for i in config_lib.ffn_layer_indices(model)}

  def label(path, leaf):
    keys = [getattr(k, "key", str(k)) for k in path]
    return "new" if len(keys) > 1 and keys[0] in new_layers and keys[1] == "mlp" else "copied"

  # One label per parameter, also when the tree holds boxed (logically partitioned) leaves, so that the groups'
  # masked optimizer states hold whole boxes or nothing.
  return jax.tree_util.tree_map_with_path(label, params, is_leaf=lambda x: isinstance(x, flax_meta.AxisMetadata))


def frozen_schedule(schedule: optax.Schedule, freeze_steps: int) -> optax.Schedule:
  """0 for the first `freeze_steps` steps, then `schedule` at the same step (no restart of its warmup)."""
  return lambda step: jnp.where(step < freeze_steps, 0.0, schedule(step))


def make_optimizer(train: ml_collections.ConfigDict, model: ml_collections.ConfigDict):
  """Clipping + AdamW; with train.freeze_steps > 0, the copied parameters (all but the swapped feed-forward
  layers) get learning rate 0 (and so no weight decay either) for that many steps."""
  schedule = learning_rate_schedule(train)
  freeze_steps = train.freeze_steps
  if not freeze_steps:
    return optax.chain(optax.clip_by_global_norm(train.clip_norm), _adamw(train, schedule))
  return optax.chain(
    optax.clip_by_global_norm(train.clip_norm),
    optax.multi_transform(
      {"new": _adamw(train, schedule), "copied": _adamw(train, frozen_schedule(schedule, freeze_steps))},
      lambda params: freeze_labels(params, model),
    ),
  )

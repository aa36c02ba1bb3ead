"""Bad steps decided on the device, inside the jitted step: whether an update is applied.

An update is skipped (config.train.bad_steps skip or rollback) when its loss or global gradient norm is
non-finite, or exceeds the mean by `spike_sigmas` standard deviations of the last `spike_window` accepted steps.
A skipped step leaves the parameters and the optimizer state bitwise as they were; the step counter and the data
stream go on. The select sits in the update's own kernels: no host round trip, no extra pass over the state.

More: docs/modules.md, sparsetx/train/bad_steps.py.
"""

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct


class Health(struct.PyTreeNode):
  """The rolling record the spike test reads: the last W accepted steps' values (a ring: slot accepted % W)."""

  losses_W: jax.Array  # float32
  grad_norms_W: jax.Array  # float32
  accepted: jax.Array  # int32: updates applied since the record started
  bad_in_row: jax.Array  # int32: steps skipped since the last accepted one
  skipped: jax.Array  # int32: steps skipped since the record started


def fresh(train: ml_collections.ConfigDict) -> Health:
  """An empty record for config.train.spike_window steps: no spike test until it is full."""
  window = train.get("spike_window", 100)
  zeros = jnp.zeros((window,), jnp.float32)
  return Health(zeros, zeros, jnp.int32(0), jnp.int32(0), jnp.int32(0))


def limits(health: Health, sigmas: float) -> tuple[jax.Array, jax.Array]:
  """(loss limit, gradient norm limit): mean + sigmas x the standard deviation of the window; inf until full."""
  full = health.accepted >= health.losses_W.shape[0]

  def limit(values_W):
    mean = values_W.mean()
    return jnp.where(full, mean + sigmas * jnp.sqrt(jnp.mean(jnp.square(values_W - mean))), jnp.inf)

  return limit(health.losses_W), limit(health.grad_norms_W)


def judge(health: Health, loss, grad_norm, train: ml_collections.ConfigDict):
  """(skip, metrics): whether this step's update is left out (False, a constant, under bad_steps=stop), and the
  values the host reports it by."""
  loss_limit, grad_norm_limit = limits(health, float(train.get("spike_sigmas", 6.0)))
  skip = False
  if train.get("bad_steps", "stop") != "stop":
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    skip = ~finite | (loss > loss_limit) | (grad_norm > grad_norm_limit)
  return skip, dict(loss_limit=loss_limit, grad_norm_limit=grad_norm_limit)


def record(health: Health, skip, loss, grad_norm) -> Health:
  """The record after this step: an accepted step's values enter the window; a skipped one counts."""
  slot = health.accepted % health.losses_W.shape[0]
  keep = jnp.asarray(skip)
  return Health(
    losses_W=jnp.where(keep, health.losses_W, health.losses_W.at[slot].set(loss.astype(jnp.float32))),
    grad_norms_W=jnp.where(keep, health.grad_norms_W, health.grad_norms_W.at[slot].set(grad_norm.astype(jnp.float32))),
    accepted=health.accepted + jnp.where(keep, 0, 1).astype(jnp.int32),
    bad_in_row=jnp.where(keep, health.bad_in_row + 1, 0).astype(jnp.int32),
    skipped=health.skipped + jnp.where(keep, 1, 0).astype(jnp.int32),
  )


def apply_unless(skip, state, updated, loss, grad_norm):
  """`updated` (the state after the optimizer), or with `skip` the parameters and optimizer state of `state`;
  the step counter advances either way. The selects sit in the update's own fusions."""
  health = record(state.health, skip, loss, grad_norm)
  if skip is False:
    return updated.replace(health=health)

  def pick(old, new):
    return jnp.where(skip, old, new)

  return updated.replace(
    params=jax.tree.map(pick, state.params, updated.params),
    opt_state=jax.tree.map(pick, state.opt_state, updated.opt_state),
    health=health,
  )


def applied_updates(opt_state) -> jax.Array:
  """The optimizer's count of applied updates (what its schedule reads): the step less the skipped steps."""
  return optax.tree_utils.tree_get_all_with_path(opt_state, "count")[0][1]

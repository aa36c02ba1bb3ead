"""Bad steps decided on the device, inside the jitted step: whether an update is applied.

An update is skipped (config.train.bad_steps skip or rollback) when its loss or global gradient norm is
non-finite, or exceeds the mean by `spike_sigmas` standard deviations of the last `spike_window` accepted steps.
A skipped step leaves the parameters and the optimizer state bitwise as they were; the step counter and the data
stream go on. The select runs on the device (no host round trip) after the update, behind an optimization barrier:
a select fused into the update's kernels changes the update's arithmetic (see `keep_old_if`), and a run that skips
nothing must be bitwise the `stop` run.

More: docs/modules.md, sparsetx/train/bad_steps.py.
"""

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct


class Health(struct.PyTreeNode):
  """The rolling record the spike test reads: the last W accepted steps' values (a ring: slot accepted % W); and
  which of the last config.train.skipped_share_window steps were skipped (a ring: slot judged % that window), so
  the bound on the skipped share holds across resumes and rollbacks (it is checkpointed with the rest)."""

  losses_W: jax.Array  # float32
  grad_norms_W: jax.Array  # float32
  accepted: jax.Array  # int32: updates applied since the record started
  bad_in_row: jax.Array  # int32: steps skipped since the last accepted one
  skipped: jax.Array  # int32: steps skipped since the record started
  recent_skips: jax.Array  # int32 [skipped_share_window]: 1 where that slot's step was skipped


def fresh(train: ml_collections.ConfigDict) -> Health:
  """An empty record for config.train.spike_window steps: no spike test until it is full."""
  window = train.get("spike_window", 100)
  zeros = jnp.zeros((window,), jnp.float32)
  recent = jnp.zeros((train.get("skipped_share_window", 200),), jnp.int32)
  return Health(zeros, zeros, jnp.int32(0), jnp.int32(0), jnp.int32(0), recent)


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
  judged = health.accepted + health.skipped
  return Health(
    losses_W=jnp.where(keep, health.losses_W, health.losses_W.at[slot].set(loss.astype(jnp.float32))),
    grad_norms_W=jnp.where(keep, health.grad_norms_W, health.grad_norms_W.at[slot].set(grad_norm.astype(jnp.float32))),
    accepted=health.accepted + jnp.where(keep, 0, 1).astype(jnp.int32),
    bad_in_row=jnp.where(keep, health.bad_in_row + 1, 0).astype(jnp.int32),
    skipped=health.skipped + jnp.where(keep, 1, 0).astype(jnp.int32),
    recent_skips=health.recent_skips.at[judged % health.recent_skips.shape[0]].set(keep.astype(jnp.int32)),
  )


def recent_share(health: Health) -> tuple[jax.Array, jax.Array]:
  """(skipped steps among the last skipped_share_window judged, steps judged since the record started)."""
  return health.recent_skips.sum(), health.accepted + health.skipped


def keep_old_if(skip, old, new):
  """`old` where `skip`, else `new`, leaf by leaf (`new` itself when skip is the constant False of `stop`).

  Each `new` leaf passes an optimization barrier before its select, so the kernels that compute it are the `stop`
  program's. Fused into them, the select changed their numbers: XLA CPU contracts AdamW's `b1 * mu + (1 - b1) * g`
  into one FMA, and with the select in the kernel it fused the other product, so the moments differed from the
  second step on (tests/test_bad_steps_bitwise.py). A barrier per leaf rather than one over the tree lets each
  select run once its leaf is ready, so the whole updated state need not be held beside the old one."""
  if skip is False:
    return new
  return jax.tree.map(lambda o, n: jnp.where(skip, o, jax.lax.optimization_barrier(n)), old, new)


def apply_unless(skip, state, updated, loss, grad_norm):
  """`updated` (the state after the optimizer), or with `skip` the parameters and optimizer state of `state`
  (`keep_old_if`); the step counter advances either way."""
  return updated.replace(
    params=keep_old_if(skip, state.params, updated.params),
    opt_state=keep_old_if(skip, state.opt_state, updated.opt_state),
    health=record(state.health, skip, loss, grad_norm),
  )


def applied_updates(opt_state) -> jax.Array:
  """The optimizer's count of applied updates (what its schedule reads): the step less the skipped steps."""
  return optax.tree_utils.tree_get_all_with_path(opt_state, "count")[0][1]

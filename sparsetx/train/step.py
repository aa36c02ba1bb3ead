"""The train and eval steps: loss and gradients over the global batch (micro-batched), the optimizer update and the
step's metrics; `make_train_step` and `make_eval_step` jit them as every caller runs them (the loop, the
ahead-of-time compile, evaluation)."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import optax

from sparsetx import scopes
from sparsetx.models.ffn import selection_bias
from sparsetx.models.ffn.registry import SPECS
from sparsetx.parallel import logical_rules, microbatches
from sparsetx.train import bad_steps, param_groups
from sparsetx.train import loss as loss_lib
from sparsetx.train.optimizer import learning_rate_schedule
from sparsetx.train.tracking import usage_window


def loss_and_grads(params, batch, *, model, train: ml_collections.ConfigDict, param_specs=None):
  """(mean loss, gradients of it, real tokens, sparse-layer stats) over the global batch, accumulating over
  `microbatches` slices; the optimizer-free half of the step (tests compare it across meshes).

  With microbatches > 1 on a mesh and `param_specs` (the parameters' PartitionSpecs, as make_train_step passes
  them) the loop runs per device along every batch axis (parallel/microbatches.py), so every gradient is
  reduced once per step instead of once per microbatch."""
  m = train.microbatches
  mesh = jax.sharding.get_abstract_mesh()
  rows, seq_len = batch["inputs"].shape
  axes = () if param_specs is None else microbatches.loop_axes(m, rows, mesh, logical_rules.active_rules())
  # The selection biases (selection_bias.py) are read, not differentiated: no gradient (nor its reduction) exists
  # for them; they enter as constants. Without balancing, `biases` is empty and the step is the one before them.
  params, biases = selection_bias.split(params)
  constants = (biases,) if biases else ()
  summed = functools.partial(loss_lib.summed_loss, model, train)
  if biases:
    summed = functools.partial(_with_biases, summed)
  if axes:
    param_specs = selection_bias.split(param_specs)[0]
    loss_sum, weight_sum, grads, stats = microbatches.accumulate(
      summed, init_model(model, seq_len), params, batch, m, mesh, axes, param_specs, constants
    )
  else:  # the compiler's loop: the whole batch on every call, its sharding left to the compiler
    loss = lambda params, microbatch: summed(1, lambda tap: tap, params, microbatch, *constants)  # noqa: E731
    grad_fn = jax.value_and_grad(loss, has_aux=True)
    if m == 1:
      (loss_sum, (weight_sum, stats)), grads = grad_fn(params, batch)
    else:
      loss_sum, weight_sum, grads, stats = microbatches.sum_over(grad_fn, params, microbatches.split(batch, m))
  grads = selection_bias.merge(grads, {path: jnp.zeros_like(bias) for path, bias in biases.items()})
  return _mean(loss_sum, weight_sum, grads, stats)


def _with_biases(summed, n_devices, gather, params, microbatch, biases):
  """`summed` on the params with the selection biases put back."""
  return summed(n_devices, gather, selection_bias.merge(params, biases), microbatch)


def _mean(loss_sum, weight_sum, grads, stats):
  """The loss and gradients per real token."""
  denominator = jnp.maximum(weight_sum, 1.0)
  return loss_sum / denominator, jax.tree.map(lambda g: g / denominator, grads), weight_sum, stats


def init_model(model, seq_len: int):
  """A function tracing the model's init on one row of `seq_len` tokens (the tables it declares)."""
  return lambda: model.init(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))


def loop_param_bytes(config, model, abstract_params, mesh) -> int:
  """Bytes one device holds of the parameters as the train step's micro-batch loop takes them."""
  axes = microbatches.loop_axes(config.train.microbatches, config.data.global_batch_size, mesh, config.mesh.rules)
  return microbatches.loop_param_bytes(init_model(model, config.data.seq_len), abstract_params, mesh, axes)


def train_step(state, batch, *, model, train: ml_collections.ConfigDict, schedule, param_specs=None):
  """One optimizer step over the global batch.

  The loss is the weighted mean over every real token of the global batch, so the result does not
  depend on how the batch is split into micro-batches or over devices.
  """
  loss, grads, weight_sum, stats = loss_and_grads(
    state.params, batch, model=model, train=train, param_specs=param_specs
  )
  # The window's usage counts (usage_window.py): the step's own, summed over its micro-batches (stats are their mean).
  counts = {
    key.removeprefix(usage_window.COUNTS): stats.pop(key) for key in list(stats) if key.startswith(usage_window.COUNTS)
  }
  # The norms read every gradient and parameter as the update does; the compiler fuses them into its kernels. The
  # bad-step select (bad_steps.py) stays out of them, so that a run that skips nothing computes what `stop` does.
  with jax.named_scope(scopes.OPTIMIZER):
    grad_norm = optax.tree.norm(grads)
    skip, limits = bad_steps.judge(state.health, loss, grad_norm, train)
    applied = state.apply_gradients(grads=grads)
    biases = selection_bias.split(state.params)[1]
    if biases:  # moved by their rule from the step's counts, not by the optimizer (their gradient is 0)
      moved = selection_bias.moved(biases, counts, model.cfg, lambda ffn, c: SPECS[ffn.type].bias_loads(ffn, c))
      applied = applied.replace(params=selection_bias.merge(applied.params, moved))
    new_state = bad_steps.apply_unless(skip, state, applied, loss, grad_norm)
    param_norm = optax.tree.norm(new_state.params)
    updates = jax.tree.map(jnp.subtract, new_state.params, state.params)
    groups = {f"grad_norm/{g}": norm for g, norm in param_groups.group_norms(grads).items()}
    groups.update({f"update_norm/{g}": norm for g, norm in param_groups.group_norms(updates).items()})
  # Counts are left out with a skipped update, whose routing came from the batch that made it bad.
  usage = {name: state.usage[name] + train.microbatches * counts[name] for name in state.usage}
  new_state = new_state.replace(usage=bad_steps.keep_old_if(skip, state.usage, usage))
  metrics = dict(
    loss=loss,
    perplexity=jnp.exp(loss),
    learning_rate=schedule(bad_steps.applied_updates(state.opt_state)),
    grad_norm=grad_norm,
    param_norm=param_norm,
    tokens=weight_sum,
    skipped=jnp.asarray(skip, jnp.float32),
    skipped_steps=new_state.health.skipped,
    bad_in_row=new_state.health.bad_in_row,
    **dict(zip(("recent_skips", "judged_steps"), bad_steps.recent_share(new_state.health))),
    **limits,
    **groups,
    **stats,
  )
  return new_state, metrics


def eval_step(params, batch, *, model):
  """Summed cross-entropy and token count of one batch (padding has weight 0; no auxiliary losses)."""
  loss_BT, _ = loss_lib.token_losses(model, params, batch, 0.0)
  weights_BT = batch["loss_weights"]
  return dict(loss_sum=(loss_BT * weights_BT).sum(), tokens=weights_BT.sum())


def make_train_step(config: ml_collections.ConfigDict, setup):
  """`train_step` jitted on `setup`'s shardings (a `state.Setup`): (state, batch) -> (state, metrics), the
  state donated. Trace it under `logical_rules.activate(setup.mesh, ...)`, as the loop does."""
  step = functools.partial(
    train_step,
    model=setup.model,
    train=config.train,
    schedule=learning_rate_schedule(config.train),
    param_specs=jax.tree.map(lambda sharding: sharding.spec, setup.shardings.params),
  )
  return jax.jit(
    step,
    in_shardings=(setup.shardings, setup.batch_sharding),
    out_shardings=(setup.shardings, None),
    donate_argnums=0,
  )


def make_eval_step(model, param_shardings, batch_sharding):
  """`eval_step` jitted: (params laid out as `param_shardings`, batch) -> dict(loss_sum, tokens)."""
  return jax.jit(functools.partial(eval_step, model=model), in_shardings=(param_shardings, batch_sharding))

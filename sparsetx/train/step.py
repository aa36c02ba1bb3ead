"""The train and eval steps: token cross-entropy with packing weights, accumulation, metrics; `make_train_step`
and `make_eval_step` jit them as every caller runs them (the loop, the ahead-of-time compile, evaluation)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from sparsetx.models import transformer
from sparsetx.models.ffn import moe
from sparsetx.train.optimizer import learning_rate_schedule
from sparsetx.train.sparse_stats import sparse_stats


def _token_cross_entropy(logits_BTV, targets_BT, z_loss: float):
  """Cross-entropy + z_loss * logZ**2 of each token, from its float32 logits."""
  ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
  if z_loss:
    ce_BT = ce_BT + z_loss * jax.nn.logsumexp(logits_BTV, axis=-1) ** 2
  return ce_BT


def loss_chunk_count(seq_len: int, loss_chunks: int) -> int:
  """How many sequence slices the chunked loss runs: the largest divisor of seq_len not above loss_chunks
  (1: unchunked). A constant, so the device loop has the same trips at any batch size."""
  return max((n for n in range(1, max(loss_chunks, 1) + 1) if seq_len % n == 0), default=1)


def chunked_token_losses(cfg, params, hidden_BTD, targets_BT, z_loss: float, n_chunks: int):
  """`token_losses`' per-token loss [B,T] from the final-norm outputs, the LM head applied to one slice of
  T/n_chunks positions at a time under a `lax.scan`: the slice function is `jax.checkpoint`ed, so the forward
  keeps no logits and the backward recomputes each slice's, and only one slice's [B, T/n, vocab] float32 logits
  (and their softmax) are alive at once instead of the whole [B, T, vocab]. The batch axis stays whole in each
  slice, so its data-parallel sharding is untouched. Same math as the plain loss: only the float32 summation order
  of the head's gradient differs (summed over slices)."""
  B, T, D = hidden_BTD.shape
  c = T // n_chunks
  hidden_NBcD = jnp.moveaxis(hidden_BTD.reshape(B, n_chunks, c, D), 1, 0)
  targets_NBc = jnp.moveaxis(targets_BT.reshape(B, n_chunks, c), 1, 0)

  @jax.checkpoint
  def slice_losses(head, x_BcD, targets_Bc):
    logits_BcV = nn.with_logical_constraint(transformer.head_logits(cfg, head, x_BcD), ("batch", "length", "vocab"))
    return _token_cross_entropy(logits_BcV, targets_Bc, z_loss)

  # float32 before the loop (as head_logits casts), so the backward sums the slices' head gradients in float32
  # and rounds to the parameters' dtype once, as the plain loss does.
  head = jax.tree.map(lambda w: w.astype(jnp.float32), transformer.head_params(cfg, params))
  ce_NBc = jax.lax.map(lambda xs: slice_losses(head, *xs), (hidden_NBcD, targets_NBc))
  return jnp.moveaxis(ce_NBc, 0, 1).reshape(B, T)


def token_losses(model, params, batch, z_loss: float, loss_chunks: int = 0):
  """Per-token loss [B,T] (cross-entropy + z_loss * logZ**2) and the model's intermediates.

  loss_chunks > 1 (config.train.loss_chunks): the head and loss run by `chunked_token_losses`, so the full
  logits never exist; the intermediates are the same but for the `logits` tap, which is then not taken."""
  n_chunks = loss_chunk_count(batch["inputs"].shape[1], loss_chunks)
  out, state = model.apply(
    {"params": params},
    batch["inputs"],
    batch["positions"],
    batch["segment_ids"],
    head=n_chunks == 1,
    mutable=["intermediates"],
  )
  if n_chunks == 1:
    return _token_cross_entropy(out, batch["targets"], z_loss), state["intermediates"]
  ce_BT = chunked_token_losses(model.cfg, params, out, batch["targets"], z_loss, n_chunks)
  return ce_BT, state["intermediates"]


def _summed_loss(model, z_loss, loss_chunks, params, batch):
  """Weighted sum of the token losses, plus the MoE balancing losses (means over the batch's real tokens,
  models/ffn/moe.py) times its token weight, so the step's mean loss carries them once."""
  loss_BT, intermediates = token_losses(model, params, batch, z_loss, loss_chunks)
  weights_BT = batch["loss_weights"]
  weight_sum = weights_BT.sum()
  balance = moe.balance_loss(model.cfg, intermediates, weights_BT)
  return (loss_BT * weights_BT).sum() + balance * weight_sum, (weight_sum, intermediates)


def loss_and_grads(params, batch, *, model, train: ml_collections.ConfigDict):
  """(mean loss, gradients of it, real tokens, sparse-layer stats) over the global batch, accumulating over
  `microbatches` slices; the optimizer-free half of the step (tests compare it across meshes)."""
  grad_fn = jax.value_and_grad(
    functools.partial(_summed_loss, model, train.z_loss, train.get("loss_chunks", 0)), has_aux=True
  )
  m = train.microbatches
  if m == 1:
    (loss_sum, (weight_sum, intermediates)), grads = grad_fn(params, batch)
    stats = sparse_stats(model.cfg, intermediates, batch["loss_weights"])
  else:
    micro = jax.tree.map(lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:]), batch)

    def accumulate(carry, microbatch):
      (loss_sum, (weight_sum, intermediates)), grads = grad_fn(params, microbatch)
      total_loss, total_weight, total_grads = carry
      stats = sparse_stats(model.cfg, intermediates, microbatch["loss_weights"])
      return (total_loss + loss_sum, total_weight + weight_sum, jax.tree.map(jnp.add, total_grads, grads)), stats

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss_sum, weight_sum, grads), stats = jax.lax.scan(accumulate, (0.0, 0.0, zeros), micro)
    stats = jax.tree.map(lambda s: s.mean(0), stats)  # the mean over micro-batches
  denominator = jnp.maximum(weight_sum, 1.0)
  grads = jax.tree.map(lambda g: g / denominator, grads)
  return loss_sum / denominator, grads, weight_sum, stats


def train_step(state, batch, *, model, train: ml_collections.ConfigDict, schedule):
  """One optimizer step over the global batch.

  The loss is the weighted mean over every real token of the global batch, so the result does not
  depend on how the batch is split into micro-batches or over devices.
  """
  loss, grads, weight_sum, stats = loss_and_grads(state.params, batch, model=model, train=train)
  new_state = state.apply_gradients(grads=grads)
  metrics = dict(
    loss=loss,
    perplexity=jnp.exp(loss),
    learning_rate=schedule(state.step),
    grad_norm=optax.tree.norm(grads),
    param_norm=optax.tree.norm(new_state.params),
    tokens=weight_sum,
    **stats,
  )
  return new_state, metrics


def eval_step(params, batch, *, model):
  """Summed cross-entropy and token count of one batch (padding has weight 0; no auxiliary losses)."""
  loss_BT, _ = token_losses(model, params, batch, 0.0)
  weights_BT = batch["loss_weights"]
  return dict(loss_sum=(loss_BT * weights_BT).sum(), tokens=weights_BT.sum())


def make_train_step(config: ml_collections.ConfigDict, setup):
  """`train_step` jitted on `setup`'s shardings (a `state.Setup`): (state, batch) -> (state, metrics), the
  state donated. Trace it under `expert_parallel.activate(setup.mesh, ...)`, as the loop does."""
  step = functools.partial(
    train_step, model=setup.model, train=config.train, schedule=learning_rate_schedule(config.train)
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

"""The train and eval steps: token cross-entropy with packing weights, accumulation, metrics; `make_train_step`
and `make_eval_step` jit them as every caller runs them (the loop, the ahead-of-time compile, evaluation)."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import PartitionSpec as P

from sparsetx.models import transformer
from sparsetx.models.ffn import moe
from sparsetx.parallel import dispatch
from sparsetx.parallel import expert_parallel as ep
from sparsetx.train.optimizer import learning_rate_schedule
from sparsetx.train.sparse_stats import sparse_stats


def _token_cross_entropy(logits_BTV, targets_BT, z_loss: float):
  """Cross-entropy + z_loss * logZ**2 of each token, from its float32 logits."""
  ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
  if z_loss:
    ce_BT = ce_BT + z_loss * jax.nn.logsumexp(logits_BTV, axis=-1) ** 2
  return ce_BT


def loss_chunk_count(vocab_size: int, loss_chunks: int) -> int:
  """How many vocabulary tiles the chunked loss runs: loss_chunks, at most one per vocabulary entry (0 or 1:
  unchunked). A constant, so the device loop has the same trips at any number of tokens."""
  return max(1, min(loss_chunks, vocab_size))


def chunked_token_losses(cfg, params, hidden_BTD, targets_BT, z_loss: float, n_tiles: int):
  """`token_losses`' per-token loss [B,T] from the final-norm outputs, the LM head applied one vocabulary tile of
  ceil(V/n_tiles) columns at a time under a `lax.scan` with an online logsumexp (running max and rescaled sum, and
  the target's logit picked from its tile). The tile function is `jax.checkpoint`ed, so the forward keeps only the
  [B,T] carries and the backward recomputes each tile's logits: one tile's [B, T, V/n] float32 logits are alive at
  a time instead of the whole [B, T, V]. A vocabulary n does not divide is padded with zero columns, masked out.

  Tiles of the vocabulary, not of the tokens: each tile's head gradient is its own columns (the data-parallel
  reduction of the head's gradient moves the same bytes as the plain loss's, in n pieces), and the batch keeps its
  sharding. Same math as the plain loss; the sums over the vocabulary are taken per tile, then over tiles."""
  B, T, _ = hidden_BTD.shape
  x_BTD = hidden_BTD.astype(jnp.float32)
  # float32 before the loop (as head_logits casts), so the backward sums the head gradient in float32 and rounds
  # to the parameters' dtype once, as the plain loss does.
  head = jax.tree.map(lambda w: w.astype(jnp.float32), transformer.head_params(cfg, params))
  V = cfg.vocab_size
  v = -(-V // n_tiles)
  if cfg.tie_embeddings:
    w_VD = jnp.pad(head["embed"]["embedding"], ((0, n_tiles * v - V), (0, 0)))
    tiles = w_VD.reshape(n_tiles, v, w_VD.shape[1])  # [n, v, D]
    spec = "btd,vd->btv"
  else:
    w_DV = jnp.pad(head["lm_head"]["kernel"], ((0, 0), (0, n_tiles * v - V)))
    tiles = jnp.moveaxis(w_DV.reshape(w_DV.shape[0], n_tiles, v), 1, 0)  # [n, D, v]
    spec = "btd,dv->btv"

  @jax.checkpoint
  def tile(carry, xs):
    max_BT, sum_BT, target_BT = carry
    w_tile, first = xs
    logits_BTv = nn.with_logical_constraint(jnp.einsum(spec, x_BTD, w_tile), ("batch", "length", "vocab"))
    column_v = first + jnp.arange(v)
    logits_BTv = jnp.where((column_v < V)[None, None, :], logits_BTv, -jnp.inf)  # the padding's columns
    # The running max only shifts the exponentials (logsumexp does not depend on it): no gradient through it.
    new_max_BT = jax.lax.stop_gradient(jnp.maximum(max_BT, logits_BTv.max(-1)))
    sum_BT = sum_BT * jnp.exp(max_BT - new_max_BT) + jnp.exp(logits_BTv - new_max_BT[..., None]).sum(-1)
    hit_BTv = column_v[None, None, :] == targets_BT[..., None]
    target_BT = target_BT + jnp.where(hit_BTv, logits_BTv, 0.0).sum(-1)
    return (new_max_BT, sum_BT, target_BT), None

  start = (jnp.full((B, T), -jnp.inf), jnp.zeros((B, T)), jnp.zeros((B, T)))
  (max_BT, sum_BT, target_BT), _ = jax.lax.scan(tile, start, (tiles, jnp.arange(n_tiles) * v))
  log_z_BT = max_BT + jnp.log(sum_BT)
  ce_BT = log_z_BT - target_BT
  if z_loss:
    ce_BT = ce_BT + z_loss * log_z_BT**2
  return ce_BT


def token_losses(model, params, batch, z_loss: float, loss_chunks: int = 0):
  """Per-token loss [B,T] (cross-entropy + z_loss * logZ**2) and the model's intermediates.

  loss_chunks > 1 (config.train.loss_chunks): the head and loss run by `chunked_token_losses`, so the full
  logits never exist; the intermediates are the same but for the `logits` tap, which is then not taken."""
  n_chunks = loss_chunk_count(model.cfg.vocab_size, loss_chunks)
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


def loss_and_grads(params, batch, *, model, train: ml_collections.ConfigDict, param_specs=None):
  """(mean loss, gradients of it, real tokens, sparse-layer stats) over the global batch, accumulating over
  `microbatches` slices; the optimizer-free half of the step (tests compare it across meshes).

  With microbatches > 1 on a mesh and `param_specs` (the parameters' PartitionSpecs, as make_train_step passes
  them) the loop runs per device along every batch axis (`_per_device_accumulation`), so every gradient is
  reduced once per step instead of once per microbatch."""
  grad_fn = jax.value_and_grad(
    functools.partial(_summed_loss, model, train.z_loss, train.get("loss_chunks", 0)), has_aux=True
  )
  m = train.microbatches
  mesh = jax.sharding.get_abstract_mesh()
  axes = ()
  if param_specs is not None:
    axes = per_device_loop_axes(m, jax.tree.leaves(batch)[0].shape[0], mesh, ep.active_rules())
  if axes:
    loss_sum, weight_sum, grads, stats = _per_device_accumulation(params, batch, model, train, mesh, axes, param_specs)
  elif m == 1:
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


def _per_device_accumulation(params, batch, model, train, mesh, axes, param_specs):
  """The microbatch loop in a shard_map manual over every batch axis `axes` (ep.per_device_axes: data, fsdp,
  expert): each device accumulates the gradients of its own tokens, and every gradient is reduced once, after
  the loop. In the compiler's loop every gradient is reduced over the batch's devices inside each microbatch (it
  is added to a carry laid out like the parameter), and FSDP's gather-transpose reduce-scatters there too.

  Parameters enter as `_loop_specs` gives: the sparse layers' tables (`dispatch.table_param`) as this device's
  blocks along the axes their dispatcher splits them over (its collectives run inside the loop on the manual
  axes, explicitly; the tables never move), every other parameter whole along `axes` (an FSDP- or expert-split
  one all-gathered once, before the loop). After the loop each gradient is reduce-scattered over the manual
  axes its stored layout splits it over (FSDP's reduce-scatter, once) and all-reduced over the rest but its
  blocks' (a table's gradient is its own block's already over its expert group: summed over `data` only).

  check_vma is off, so every value is the device's own and the step's loss is the sum of the devices' losses.
  Terms that need the whole microbatch (the MoE balancing losses, the sparse-layer stats) read the per-token taps
  all-gathered over `axes`; each device adds 1/devices of the balancing term, whose gradient the all-gather's
  transpose (a reduce-scatter of the taps, not of a gradient) sums back to the devices' own tokens."""
  m = train.microbatches
  n_devices = math.prod(mesh.shape[a] for a in axes)
  gather = functools.partial(jax.lax.all_gather, axis_name=axes, axis=0, tiled=True)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  stored = treedef.flatten_up_to(param_specs)
  loop = _loop_specs(model, batch["inputs"].shape[1], leaves, stored, axes)

  def device_loss(params, microbatch):
    loss_BT, intermediates = token_losses(model, params, microbatch, train.z_loss, train.get("loss_chunks", 0))
    weights_BT = microbatch["loss_weights"]
    # The sparse layers' per-token taps [b, T, ...] (what balance_loss and sparse_stats read), whole microbatch.
    taps = {
      layer: {"mlp": jax.tree.map(gather, values["mlp"])}
      for layer, values in intermediates.items()
      if layer.startswith("layers_") and "mlp" in values
    }
    all_weights_BT = gather(weights_BT)
    balance = moe.balance_loss(model.cfg, taps, all_weights_BT)
    total = (loss_BT * weights_BT).sum() + balance * all_weights_BT.sum() / n_devices
    return total, (weights_BT.sum(), sparse_stats(model.cfg, taps, all_weights_BT))

  grad_fn = jax.value_and_grad(device_loss, has_aux=True)

  def per_device(params, micro):
    def accumulate(carry, microbatch):
      (loss_sum, (weight_sum, stats)), grads = grad_fn(params, microbatch)
      total_loss, total_weight, total_grads = carry
      return (total_loss + loss_sum, total_weight + weight_sum, jax.tree.map(jnp.add, total_grads, grads)), stats

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss_sum, weight_sum, grads), stats = jax.lax.scan(accumulate, (0.0, 0.0, zeros), micro)
    # The step's one reduction of each gradient, over every batch axis but its blocks'.
    reduced = [_reduce_once(g, spec, block, axes) for g, spec, block in zip(jax.tree.leaves(grads), stored, loop)]
    loss_sum, weight_sum = jax.lax.psum((loss_sum, weight_sum), axes)
    return loss_sum, weight_sum, treedef.unflatten(reduced), jax.tree.map(lambda s: s.mean(0), stats)

  # The microbatches are the global batch's row blocks, as in the compiler's loop (the same tokens per microbatch,
  # so the same balancing losses and stats); each device takes its rows of each.
  micro = jax.tree.map(lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:]), batch)
  grad_specs = treedef.unflatten([_manual_spec(spec, axes) for spec in stored])
  return jax.shard_map(
    per_device,
    mesh=mesh,
    in_specs=(treedef.unflatten(loop), P(None, axes)),
    out_specs=(P(), P(), grad_specs, P()),
    axis_names=set(axes),
    check_vma=False,
  )(params, micro)


def per_device_loop_axes(microbatches: int, rows: int, mesh, rules) -> tuple:
  """The batch axes the step's microbatch loop runs per device along (`_per_device_accumulation`): every batch
  axis with microbatches > 1 on a mesh; none (the compiler's loop) when each microbatch's `rows` of the global
  batch do not split evenly over their devices."""
  if microbatches == 1 or mesh is None or mesh.empty:
    return ()
  axes = ep.per_device_axes(mesh, rules)
  return axes if (rows // microbatches) % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def loop_param_bytes(config, model, abstract_params, mesh) -> int:
  """Bytes one device holds of the parameters as the per-device microbatch loop takes them (`_loop_specs`: the
  tables' blocks, every other parameter whole along the batch axes), or as stored without that loop. Its
  gradient sum has this size too: the device memory estimate (train/aot.py) counts both."""
  axes = per_device_loop_axes(config.train.microbatches, config.data.global_batch_size, mesh, config.mesh.rules)
  leaves = jax.tree_util.tree_leaves_with_path(abstract_params)
  stored = [leaf.sharding.spec for _, leaf in leaves]
  loop = _loop_specs(model, config.data.seq_len, leaves, stored, axes) if axes else stored
  total = 0
  for (_, leaf), spec, block in zip(leaves, stored, loop):
    pad = (None,) * leaf.ndim
    # Split along a dimension: the axes the loop leaves to the compiler, and the block's manual ones.
    split = [
      {a for a in _entry_axes(e) if a not in axes} | set(_entry_axes(b))
      for e, b in zip(tuple(spec) + pad, tuple(block) + pad)
    ]
    total += (
      math.prod(n // math.prod(mesh.shape[a] for a in s) for n, s in zip(leaf.shape, split)) * leaf.dtype.itemsize
    )
  return total


def _entry_axes(entry) -> tuple:
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _manual_spec(spec: P, axes) -> P:
  """`spec` restricted to the manual axes `axes` (what a shard_map manual over them may name)."""
  return P(*(tuple(a for a in _entry_axes(entry) if a in axes) or None for entry in spec))


def _loop_specs(model, seq_len: int, leaves, stored, axes) -> list:
  """Each parameter's spec entering the per-device loop: a table's (`dispatch.table_param`, learned by tracing
  the model's init under `dispatch.recording_tables`) keeps the manual axes of the dimensions its dispatcher
  takes as blocks; every other parameter is whole along the manual axes."""
  with dispatch.recording_tables() as tables:
    jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32)))
  specs = []
  for (path, leaf), spec in zip(leaves, stored):
    names, local = tables.get(tuple(getattr(k, "key", k) for k in path), ((None,) * leaf.ndim, ()))
    entries = tuple(spec) + (None,) * (leaf.ndim - len(spec))
    specs.append(_manual_spec(P(*(e if name in local else None for e, name in zip(entries, names))), axes))
  return specs


def _reduce_once(g, spec: P, block: P, axes):
  """A device's accumulated gradient of a parameter stored as `spec` that entered the loop as `block`, summed over
  the devices of `axes`: reduce-scattered along each dimension the stored layout splits over manual axes the block
  does not (so it leaves as stored), then all-reduced over the manual axes left; nothing over the block's axes."""
  blocks = {a for entry in block for a in _entry_axes(entry)}
  scatters = [
    (dim, entry)
    for dim, (entry, taken) in enumerate(zip(_manual_spec(spec, axes), tuple(block) + (None,) * len(spec)))
    if entry and not taken
  ]
  rest = tuple(a for a in axes if a not in blocks and all(a not in entry for _, entry in scatters))
  for dim, entry in scatters:
    g = jax.lax.psum_scatter(g, entry, scatter_dimension=dim, tiled=True)
  if scatters and rest:
    # Scattered first, so the all-reduce moves 1/S of the gradient. The barrier keeps the two apart: without it the
    # CPU program (jax 0.10.2) gave every block the sum of all blocks (the router keys' gradient on data=2 x
    # expert=4, tests/test_gradient_reduction.py), though the HLO reads right.
    g = jax.lax.optimization_barrier(g)
  return jax.lax.psum(g, rest) if rest else g


def train_step(state, batch, *, model, train: ml_collections.ConfigDict, schedule, param_specs=None):
  """One optimizer step over the global batch.

  The loss is the weighted mean over every real token of the global batch, so the result does not
  depend on how the batch is split into micro-batches or over devices.
  """
  loss, grads, weight_sum, stats = loss_and_grads(
    state.params, batch, model=model, train=train, param_specs=param_specs
  )
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

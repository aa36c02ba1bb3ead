"""The vocabulary-tiled cross-entropy (train/loss.py chunked_token_losses, config.train.loss_chunks): the same loss
and gradients as the plain loss over the whole [B,T,vocab] logits, and a train step whose temporaries stay below
those logits' bytes at a long sequence."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import init_params, load_config

from sparsetx import config as config_lib
from sparsetx.measure import aot
from sparsetx.models import transformer
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import loss as loss_lib
from sparsetx.train import step as step_lib

EPS32 = float(jnp.finfo(jnp.float32).eps)
EPS_BF16 = float(jnp.finfo(jnp.bfloat16).eps)
B, T, D, V = 4, 32, 32, 320
Z_LOSS = 1e-2


def head_config(tied: bool, V: int, logits_dot_in_fp32: bool = True):
  return ml_collections.FrozenConfigDict(
    dict(tie_embeddings=tied, vocab_size=V, dtype="bfloat16", logits_dot_in_fp32=logits_dot_in_fp32)
  )


def head_and_inputs(tied: bool, dtype, V: int):
  keys = jax.random.split(jax.random.key(0), 4)
  weights = jax.random.normal(keys[0], (V, D) if tied else (D, V)) * 0.5
  head = {"embed": {"embedding": weights}} if tied else {"lm_head": {"kernel": weights}}
  hidden_BTD = jax.random.normal(keys[1], (B, T, D))
  targets_BT = jax.random.randint(keys[2], (B, T), 0, V)
  weights_BT = (jax.random.uniform(keys[3], (B, T)) > 0.2).astype(jnp.float32)  # packing: some tokens weigh 0
  return jax.tree.map(lambda a: a.astype(dtype), head), hidden_BTD.astype(dtype), targets_BT, weights_BT


@pytest.mark.parametrize(
  "tied, dtype, V, fp32",
  [(False, jnp.float32, V, True), (True, jnp.float32, V, True), (False, jnp.bfloat16, V, True)]
  + [(True, jnp.bfloat16, V, True), (False, jnp.float32, V + 3, True)]  # 8 tiles of 41 columns, the last 5 padding
  + [(False, jnp.float32, V, False), (True, jnp.float32, V, False)],  # the head's dot on bf16 operands
)
def test_chunked_loss_equals_the_plain_loss_and_its_gradients(tied, dtype, V, fp32):
  """Values and gradients (to the final hidden states and to the head / tied embedding) of the weighted summed loss
  with z-loss, over 8 vocabulary tiles (a vocabulary 8 does not divide: padded). Bounds (float32 summation; the tiles change only the order of the sums
  over the vocabulary):
  - a token's loss: its logits are the same D-term dots, its logsumexp a V-term sum taken per tile then over
    tiles: <= 4 (D + V) eps32 |loss| plus the logit error 2 D eps32 max|x||w| (a loss moves at most as much as its
    logits: softmax - onehot sums to 0 and has |.|_1 <= 2);
  - the head's gradient sums the B T token terms x_t g_t^T as the plain loss does, g_t (softmax - onehot) moved by
    that error: 2 B T eps32 sum_t |x_t||g_t| + 2 D eps32 max|g| sum_t |x_t|;
  - the hidden gradient g_t W^T is a V-term sum per token, taken per tile: 2 V eps32 sum_v |g_tv||w_v| plus
    2 V max|w| times the logit error;
  - bf16 inputs, or the dot on bf16 operands (logits_dot_in_fp32=False: both losses round the same operands, so the
    logit bound holds for the rounded ones, within it for the given): each gradient is rounded once more to bf16:
    + eps_bf16 |g|; on bf16 operands the logits' cotangent g enters the backward's dots rounded to bf16 too, and
    the two losses' g may round to neighbours: + eps_bf16 sum_t |x_t||g_t| (head), eps_bf16 sum_v |g_tv||w_v|."""
  cfg = head_config(tied, V, fp32)
  head, hidden_BTD, targets_BT, weights_BT = head_and_inputs(tied, dtype, V)

  def plain(head, hidden_BTD):
    logits_BTV = transformer.head_logits(cfg, head, hidden_BTD)
    return (loss_lib.token_cross_entropy(logits_BTV, targets_BT, Z_LOSS) * weights_BT).sum()

  def chunked(head, hidden_BTD):
    n = config_lib.loss_chunk_count(V, 8)
    return (loss_lib.chunked_token_losses(cfg, head, hidden_BTD, targets_BT, Z_LOSS, n) * weights_BT).sum()

  assert config_lib.loss_chunk_count(V, 8) == 8
  (value, grads), (want, want_grads) = (
    jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(head, hidden_BTD) for f in (chunked, plain)
  )
  x_ND = np.abs(np.asarray(hidden_BTD, np.float64)).reshape(B * T, D)
  w_DV = np.abs(np.asarray(jax.tree.leaves(head)[0], np.float64))
  w_DV = w_DV.T if tied else w_DV
  logit_error = 2 * D * EPS32 * float((x_ND @ w_DV).max())
  np.testing.assert_allclose(value, want, rtol=4 * (D + V) * EPS32, atol=float(weights_BT.sum()) * logit_error)
  # |g_tv| of the reference: d(loss)/d(logits) of each token (softmax - onehot + z-loss term, weighted).
  g_NV = np.abs(
    np.asarray(
      jax.grad(lambda logits: (loss_lib.token_cross_entropy(logits, targets_BT, Z_LOSS) * weights_BT).sum())(
        transformer.head_logits(cfg, head, hidden_BTD)
      ),
      np.float64,
    )
  ).reshape(B * T, V)
  head_bound_DV = 2 * B * T * EPS32 * (x_ND.T @ g_NV) + 2 * D * EPS32 * float(g_NV.max()) * x_ND.sum(0)[:, None]
  hidden_bound_ND = 2 * V * EPS32 * (g_NV @ w_DV.T) + 2 * V * logit_error * w_DV.max()
  if not fp32:  # each g_tv enters the backward's dots rounded to bf16, where the two losses' g may round apart
    head_bound_DV += EPS_BF16 * (x_ND.T @ g_NV)
    hidden_bound_ND += EPS_BF16 * (g_NV @ w_DV.T)
  (head_grad,), (want_head_grad,) = jax.tree.leaves(grads[0]), jax.tree.leaves(want_grads[0])
  head_grad, want_head_grad = (np.asarray(g, np.float64) for g in (head_grad, want_head_grad))
  if tied:
    head_grad, want_head_grad = head_grad.T, want_head_grad.T
  rounding = EPS_BF16 if dtype == jnp.bfloat16 or not fp32 else 0.0
  assert np.all(np.abs(head_grad - want_head_grad) <= head_bound_DV + rounding * np.abs(want_head_grad))
  hidden_grad, want_hidden_grad = (np.asarray(g, np.float64).reshape(B * T, D) for g in (grads[1], want_grads[1]))
  assert np.all(np.abs(hidden_grad - want_hidden_grad) <= hidden_bound_ND + rounding * np.abs(want_hidden_grad))
  assert grads[1].dtype == dtype and jax.tree.leaves(grads[0])[0].dtype == dtype


@pytest.mark.parametrize("tied", [False, True])
def test_the_head_dot_on_bf16_operands_is_the_float32_dot_of_the_rounded_operands(tied):
  """logits_dot_in_fp32=False: the logits are the float32 sums of products of the bf16-rounded hidden states and head
  weights (each product exact in float32), so they equal the float64 product of the rounded operands within the
  D-term float32 summation, 2 D eps32 sum_d |x_d w_d|; the default's operands are the float32 values themselves.
  Checked on the model's own head (Transformer: its tied einsum or its lm_head Dense) and on head_logits."""
  config = micro_model_config(tied, 0)
  config.model.update(dtype="bfloat16", logits_dot_in_fp32=False)
  tokens = jax.random.randint(jax.random.key(2), (B, T), 0, V)
  for fp32 in (False, True):
    config.model.logits_dot_in_fp32 = fp32
    model = transformer.Transformer(ml_collections.FrozenConfigDict(config.model))
    params = init_params(model, tokens)
    hidden_BTD = model.apply({"params": params}, tokens, head=False)
    logits_BTV = model.apply({"params": params}, tokens)
    w = transformer.head_params(model.cfg, params)
    w_DV = jax.tree.leaves(w)[0].T if tied else jax.tree.leaves(w)[0]
    round_to = jnp.float32 if fp32 else jnp.bfloat16
    x_ND, w_DV = (np.asarray(a.astype(round_to), np.float64) for a in (hidden_BTD.reshape(B * T, D), w_DV))
    want_NV, bound_NV = x_ND @ w_DV, 2 * D * EPS32 * (np.abs(x_ND) @ np.abs(w_DV))
    for got in (logits_BTV, transformer.head_logits(model.cfg, params, hidden_BTD)):
      assert got.dtype == jnp.float32
      assert np.all(np.abs(np.asarray(got, np.float64).reshape(B * T, V) - want_NV) <= bound_NV)


def micro_model_config(tied: bool, loss_chunks: int) -> ml_collections.ConfigDict:
  config = load_config("configs/tiny.py", "mlp")
  config.model.update(d_model=D, n_layers=1, head_dim=D, max_len=T, vocab_size=V, dtype="float32", tie_embeddings=tied)
  config.data.update(seq_len=T, global_batch_size=B)
  config.train.update(z_loss=Z_LOSS, loss_chunks=loss_chunks)
  return config_lib.validate(config)


@pytest.mark.parametrize("tied", [False, True])
def test_the_step_with_chunks_equals_the_step_without(tied):
  """loss_and_grads over a whole model (z-loss, packing weights): the same loss and every parameter's gradient,
  within 64 eps32 of each leaf's largest element (the head bound above, summed back through one layer)."""
  keys = jax.random.split(jax.random.key(1), 2)
  batch = dict(
    inputs=jax.random.randint(keys[0], (B, T), 0, V),
    targets=jax.random.randint(keys[1], (B, T), 0, V),
    positions=jnp.broadcast_to(jnp.arange(T), (B, T)),
    segment_ids=jnp.ones((B, T), jnp.int32),
    loss_weights=jnp.ones((B, T)).at[:, -3:].set(0.0),
  )
  results = []
  for loss_chunks in (8, 0):
    config = micro_model_config(tied, loss_chunks)
    model = transformer.Transformer(ml_collections.FrozenConfigDict(config.model))
    params = init_params(model, batch["inputs"])
    run = jax.jit(lambda p, b: step_lib.loss_and_grads(p, b, model=model, train=config.train)[:2])  # noqa: B023
    results.append(run(params, batch))
  (loss, grads), (want_loss, want_grads) = results
  np.testing.assert_allclose(loss, want_loss, rtol=16 * EPS32)
  for path, g, want in zip(
    jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads), jax.tree.leaves(want_grads)
  ):
    np.testing.assert_allclose(g, want, atol=64 * EPS32 * float(jnp.abs(want).max()), rtol=0, err_msg=str(path[0]))


def test_a_long_sequence_step_keeps_its_temporaries_below_the_full_logits():
  """The compiled train step of a small model at 8 x 1,024 tokens and a 16,384 vocabulary: the whole float32 logits
  are 8 x 1,024 x 16,384 x 4 B = 512 MiB, and the plain loss needs at least them (plus their softmax and
  gradient). With loss_chunks=8 one tile's logits are 64 MiB; the rest of the step (one layer at d_model 64,
  attention's [8, 1, 1,024, 1,024] float32 scores: 32 MiB each) stays well under the full logits. So the
  bound: temporaries < the full logits' bytes, which the unchunked step exceeds."""
  batch, seq_len, vocab = 8, 1024, 16384
  logits_bytes = batch * seq_len * vocab * 4
  temps = {}
  for loss_chunks in (8, 0):
    config = load_config("configs/tiny.py", "mlp")
    config.model.update(d_model=64, n_layers=1, head_dim=64, max_len=seq_len, vocab_size=vocab, dtype="bfloat16")
    config.model.ffn.update(d_ffw=128)
    config.data.update(seq_len=seq_len, global_batch_size=batch)
    config.train.loss_chunks = loss_chunks
    config.mesh.ici.update(data=1)
    config_lib.validate(config)
    compiled, _ = aot.compile_train_step(config, mesh_lib.make_mesh(config.mesh, jax.devices()[:1]))
    temps[loss_chunks] = compiled.memory_analysis().temp_size_in_bytes
  assert temps[8] < logits_bytes <= temps[0], (temps, logits_bytes)


def test_a_negative_tile_count_is_refused():
  config = load_config("configs/tiny.py", "mlp")
  config.train.loss_chunks = -1
  with pytest.raises(config_lib.ConfigError, match=r"config.train.loss_chunks=-1 must be an integer >= 0"):
    config_lib.validate(config)


def test_bf16_hidden_gradient_is_summed_over_tiles_in_float32_and_rounded_once():
  """64 tiles of a bf16 head (logits_dot_in_fp32=False): the hidden states' gradient is the float32 sum of the tiles'
  products, rounded to bf16 once. Inputs that make everything before that rounding exact: hidden states 0, so every
  logit is 0 and each softmax 1/256 (a power of two: its bf16 cotangent 1/256, the target's 1/256 - 1 = -255/256,
  both exact), weights 0 or 1, no z-loss. The float64 reference dx_t = w_t sum_v (1/256 - onehot_v) W_v then
  bounds the result by one rounding, 2^-8 |dx|, plus the float32 sums' 2 V eps32 sum_v |g_v| |W_v|; a rounding
  after each tile (64 of them, partial sums larger than their total) breaks it."""
  V, tiles = 256, 64
  cfg = head_config(False, V, logits_dot_in_fp32=False)
  keys = jax.random.split(jax.random.key(1), 3)
  w_DV = (jax.random.normal(keys[0], (D, V)) * 0.5).astype(jnp.bfloat16)
  hidden_BTD = jnp.zeros((B, T, D), jnp.bfloat16)
  targets_BT = jax.random.randint(keys[1], (B, T), 0, V)
  weights_BT = (jax.random.uniform(keys[2], (B, T)) > 0.2).astype(jnp.float32)

  def chunked(hidden_BTD):
    losses = loss_lib.chunked_token_losses(cfg, {"lm_head": {"kernel": w_DV}}, hidden_BTD, targets_BT, 0.0, tiles)
    return (losses * weights_BT).sum()

  dx_ND = np.asarray(jax.jit(jax.grad(chunked))(hidden_BTD), np.float64).reshape(B * T, D)
  g_NV = np.full((B * T, V), 1.0 / V) - np.eye(V)[np.asarray(targets_BT).reshape(-1)]
  g_NV *= np.asarray(weights_BT, np.float64).reshape(-1, 1)
  w_VD = np.asarray(w_DV, np.float64).T
  want_ND = g_NV @ w_VD
  bound_ND = 2.0**-8 * np.abs(want_ND) + 2 * V * EPS32 * (np.abs(g_NV) @ np.abs(w_VD))
  assert np.all(np.abs(dx_ND - want_ND) <= bound_ND), np.max(np.abs(dx_ND - want_ND) - bound_ND)

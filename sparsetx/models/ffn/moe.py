"""MoE as in GPT-OSS: a linear router (with bias), top-k experts per token, softmax over the k
selected logits as mixing weights, SwiGLU experts.

Dispatch is dropless and real: the (token, slot) pairs are sorted by expert and every expert runs
one grouped matmul (sparsetx/kernels/grouped_matmul/op.py: Mosaic GPU or Triton kernels on a GPU, the native ragged
dot on TPU) over exactly the tokens routed to it. No expert sees a token it was not chosen for, and no token is
dropped for capacity.

More: docs/modules.md, sparsetx/models/ffn/moe.py.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from sparsetx import config as config_lib
from sparsetx import scopes
from sparsetx.config import ffn_checks
from sparsetx.config.placements import placement_of
from sparsetx.kernels.grouped_matmul.op import grouped_matmul
from sparsetx.kernels.options import options_from_config
from sparsetx.models.ffn import dense, selection_bias
from sparsetx.models.ffn.common import dense_init
from sparsetx.models.ffn.spec import Circuit, FfnSpec, Units
from sparsetx.models.taps import tap
from sparsetx.parallel import moe_all_to_all, own_tokens, tables
from sparsetx.perf import cost

TABLE_AXES = ("expert", "embed", "mlp")  # wi_gate, wi_up [E, d_model, d_ffw]
OUT_AXES = ("expert", "mlp", "embed")  # wo [E, d_ffw, d_model]


def balance_losses(n_experts: int, logits_BTE, expert_ids_BTA, token_weights_BT) -> dict:
  """Unweighted {'aux_loss': N * sum_i f_i * P_i, 'router_z_loss': mean logsumexp(logits)**2} over the tokens
  with weight > 0 (see the module docstring)."""
  real_BT = (token_weights_BT > 0).astype(jnp.float32)
  n_real = jnp.maximum(real_BT.sum(), 1.0)
  probs_BTE = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
  p_E = (probs_BTE * real_BT[:, :, None]).sum((0, 1)) / n_real
  real_BTA = jnp.broadcast_to(real_BT[:, :, None], expert_ids_BTA.shape)  # counted by id: no [pairs, E] one-hot
  picks_E = jax.ops.segment_sum(real_BTA.reshape(-1), expert_ids_BTA.reshape(-1), num_segments=n_experts)
  f_E = jax.lax.stop_gradient(picks_E / jnp.maximum(picks_E.sum(), 1.0))
  z_BT = jax.nn.logsumexp(logits_BTE.astype(jnp.float32), axis=-1)
  return dict(aux_loss=n_experts * jnp.sum(f_E * p_E), router_z_loss=(z_BT**2 * real_BT).sum() / n_real)


def balance_loss(model_cfg, intermediates: dict, token_weights_BT):
  """sum over MoE layers of aux_loss * (its value) + router_z_loss * (its value): what the step adds to the
  mean training loss (0.0 when no layer has a non-zero coefficient)."""
  total = 0.0
  for i in range(model_cfg.n_layers):
    ffn = config_lib.layer_ffn_config(model_cfg, i)
    coefficients = (ffn.get("aux_loss", 0.0) or 0.0, ffn.get("router_z_loss", 0.0) or 0.0)
    if ffn.type != "moe" or not any(coefficients):
      continue
    taps = intermediates[f"layers_{i}"]["mlp"]
    values = balance_losses(ffn.n_experts, taps["router_logits"][0], taps["expert_ids"][0], token_weights_BT)
    total = total + coefficients[0] * values["aux_loss"] + coefficients[1] * values["router_z_loss"]
  return total


def dispatch_experts(options, x_ND, expert_ids_NA, weights_NA, wi_gate_EDF, wi_up_EDF, wo_EFD, first_expert=0):
  """sum_k weights[n, k] * SwiGLU_{expert_ids[n, k]}(x[n]), computing only the routed pairs.

  The E experts given are ids first_expert .. first_expert + E - 1; pairs routed elsewhere sort
  after them, are left out of the grouped matmuls and contribute nothing.
  """
  N, A = expert_ids_NA.shape
  E = wi_gate_EDF.shape[0]
  local_NA = expert_ids_NA - first_expert
  local_NA = jnp.where((local_NA >= 0) & (local_NA < E), local_NA, E)
  expert_of_slot = local_NA.reshape(N * A)
  order = jnp.argsort(expert_of_slot, stable=True)
  group_sizes_E = jnp.bincount(expert_of_slot, length=E).astype(jnp.int32)
  y_SD = sorted_experts(options, x_ND[order // A], group_sizes_E, wi_gate_EDF, wi_up_EDF, wo_EFD)
  y_NAD = y_SD[jnp.argsort(order)].reshape(N, A, -1)
  return jnp.einsum("nad,na->nd", y_NAD, weights_NA.astype(jnp.float32)).astype(x_ND.dtype)


def sorted_experts(options, x_SD, group_sizes_E, wi_gate_EDF, wi_up_EDF, wo_EFD):
  """y [S, D] in x's dtype: SwiGLU_e(x[s]) for rows sorted by expert, group_sizes_E[e] rows for expert e, by grouped
  matmuls (float32 sums); rows after the last group are computed by no expert (zeros)."""

  def grouped(lhs, rhs):
    return grouped_matmul(lhs, rhs, group_sizes_E, options).astype(jnp.float32)

  h_SF = (jax.nn.silu(grouped(x_SD, wi_gate_EDF)) * grouped(x_SD, wi_up_EDF)).astype(x_SD.dtype)
  return grouped_matmul(h_SF, wo_EFD, group_sizes_E, options)


class Moe(nn.Module):
  cfg: object  # the model config (FrozenConfigDict)

  @nn.compact
  def __call__(self, x_BTD):
    ffn = self.cfg.ffn
    E, A, F, D = ffn.n_experts, ffn.experts_per_token, ffn.d_ffw, self.cfg.d_model
    param_dtype = jnp.dtype(self.cfg.param_dtype)
    with jax.named_scope(scopes.ROUTER):
      logits_BTE = nn.Dense(
        E,
        dtype=jnp.float32,
        param_dtype=param_dtype,
        kernel_init=dense_init(self.cfg.init_std, ("embed", None)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
        name="router",
      )(x_BTD.astype(jnp.float32))
      self.sow("intermediates", "router_logits", logits_BTE)  # the balancing losses' input (unused ones are pruned)
      sigmoid = ffn.get("router_scores", "softmax") == "sigmoid"
      scores_BTE = jax.nn.sigmoid(logits_BTE) if sigmoid else logits_BTE
      if selection_bias.rate(ffn):  # the bias picks the experts; the gates read the unbiased scores
        choice_BTE = (
          affinities(scores_BTE, sigmoid) + jax.lax.stop_gradient(selection_bias.param(self, (E,)))[None, None, :]
        )
        top_scores_BTA, expert_ids_BTA = own_tokens.on_own_tokens_BT(functools.partial(pick, A), choice_BTE, scores_BTE)
      else:
        top_k = lambda logits: jax.lax.top_k(logits, A)
        top_scores_BTA, expert_ids_BTA = own_tokens.on_own_tokens_BT(top_k, scores_BTE)
    weights_BTA = gates(top_scores_BTA, sigmoid)
    expert_ids_BTA = tap(self, "expert_ids", expert_ids_BTA)
    weights_BTA = tap(self, "expert_weights", weights_BTA)

    placement = placement_of(ffn)

    def table(name, shape, names):  # the experts are the dispatcher's blocks (a device's own experts)
      init = nn.initializers.normal(self.cfg.init_std)
      return tables.table_param(self, name, init, shape, param_dtype, names, ("expert",), placement)

    wi_gate = table("wi_gate", (E, D, F), TABLE_AXES)
    wi_up = table("wi_up", (E, D, F), TABLE_AXES)
    wo = table("wo", (E, F, D), OUT_AXES)
    options = options_from_config(ffn.get("kernel"))
    y_BTD = moe_all_to_all.expert_dispatch(
      functools.partial(dispatch_experts, options),
      functools.partial(sorted_experts, options),
      x_BTD,
      expert_ids_BTA,
      weights_BTA,
      (wi_gate, wi_up, wo),
      table_axes=TABLE_AXES,
      placement=placement,
      table_names=(TABLE_AXES, TABLE_AXES, OUT_AXES),
    )
    if not ffn.get("n_shared_experts", 0):
      return y_BTD
    return y_BTD + SharedExperts(self.cfg, name="shared")(x_BTD)


def pick(A: int, choice_NE, scores_NE):
  """(scores of the A experts with the highest `choice`, their ids): a choice made on biased scores, the gates' own
  scores unbiased."""
  expert_ids_NA = jax.lax.top_k(choice_NE, A)[1]
  return jnp.take_along_axis(scores_NE, expert_ids_NA, axis=-1), expert_ids_NA


def affinities(scores_BTE, sigmoid: bool):
  """What the selection bias is added to: each expert's affinity in [0, 1], the sigmoid scores (DeepSeek-V3) or the
  softmax over all the experts' logits (torchtitan), which ranks them as the logits do. A bias moved by a fixed step
  needs a bounded scale: on raw logits, whose spread grows as the router trains, 0.001 a step barely moves a choice."""
  return scores_BTE if sigmoid else jax.nn.softmax(scores_BTE, axis=-1)


def gates(top_scores_BTA, sigmoid: bool):
  """The mixing weights of the picked experts: softmax over their logits (GPT-OSS), or their sigmoid scores divided by
  their sum (DeepSeek-V3; 1e-20 keeps k scores that underflow to 0 from dividing 0 by 0, as torchtitan)."""
  if not sigmoid:
    return jax.nn.softmax(top_scores_BTA, axis=-1)
  return top_scores_BTA / (top_scores_BTA.sum(-1, keepdims=True) + 1e-20)


class SharedExperts(nn.Module):
  """n_shared_experts SwiGLU experts of d_ffw every token passes through (DeepSeek's shared experts), summed: one
  SwiGLU of n_shared_experts * d_ffw, laid out as the dense layers (dense.py)."""

  cfg: object  # the model config (FrozenConfigDict)

  @nn.compact
  def __call__(self, x_BTD):
    width = self.cfg.ffn.n_shared_experts * self.cfg.ffn.d_ffw
    gate_BTF = dense.projection(self.cfg, width, ("embed", "mlp"), "wi_gate")(x_BTD)
    up_BTF = dense.projection(self.cfg, width, ("embed", "mlp"), "wi_up")(x_BTD)
    h_BTF = nn.with_logical_constraint(jax.nn.silu(gate_BTF) * up_BTF, ("batch", "length", "mlp"))
    return dense.projection(self.cfg, self.cfg.d_model, ("mlp", "embed"), "wo")(h_BTF)


def _shared_width(ffn) -> int:
  return ffn.get("n_shared_experts", 0) * ffn.d_ffw


def _params(model, ffn) -> tuple[int, int]:
  """(total, active per token): the router (with its selection bias when balancing), the experts and the shared
  experts (every token's)."""
  D, E, S = model.d_model, ffn.n_experts, _shared_width(ffn)
  router = D * E + E + (E if selection_bias.rate(ffn) else 0)
  shared = 3 * D * S + int(model.use_bias) * (2 * S + D) if S else 0
  return router + shared + E * 3 * D * ffn.d_ffw, router + shared + ffn.experts_per_token * 3 * D * ffn.d_ffw


SIGMOID_FLOPS = 4  # per router score: exp, add, divide, and the k picked scores' sum and division (about)


def _flops(model, ffn) -> int:
  """Forward FLOPs per token: router, sigmoid scores if chosen, the k experts' SwiGLUs and the shared experts'."""
  D = model.d_model
  sigmoid = SIGMOID_FLOPS * ffn.n_experts if ffn.get("router_scores", "softmax") == "sigmoid" else 0
  return 2 * (D * ffn.n_experts + ffn.experts_per_token * 3 * D * ffn.d_ffw + 3 * D * _shared_width(ffn)) + sigmoid


def _usage_stats(ffn, counts_E, taps: dict, token_weights_BT) -> dict:
  """The busiest expert's load (1 = balanced) and, where the router logits are tapped, the balancing losses."""
  share_E = counts_E / jnp.maximum(counts_E.sum(), 1e-9)
  stats = dict(max_load=share_E.max() * ffn.n_experts)
  if "router_logits" in taps:  # the balancing losses' values (weighted into the loss by config.model.ffn)
    stats.update(balance_losses(ffn.n_experts, taps["router_logits"][0], taps["expert_ids"][0], token_weights_BT))
  return stats


def moe_cost(bld, model, ffn, n, E, G, b, devices):
  """MoE (moe.py): float32 router, top-k, dropless sort of all the group's pairs, SwiGLU experts by grouped matmuls
  over the pairs routed to this device's experts (n k on average), the permutation back and the weighted sum."""
  D, F, X, A = model.d_model, ffn.d_ffw, ffn.n_experts, ffn.experts_per_token
  x_local, N = X // E, n * E
  pairs_all, pairs = N * A, n * A
  weights = 3 * x_local * D * F
  bld.matmul("router", n, D, X, b, cost.F32, cost.F32)
  if ffn.get("router_scores", "softmax") == "sigmoid":  # read and write each score once, each way
    bld.add("router sigmoid", 2 * n * X * cost.F32, SIGMOID_FLOPS * n * X, forward=True)
    bld.add("router sigmoid backward", 3 * n * X * cost.F32, 3 * n * X)
  bld.add(
    "router top-k", n * X * cost.F32 + n * A * (cost.F32 + cost.INDEX), n * X * cost.TOP_K_OPS_PER_SCORE, forward=True
  )
  bld.cast(weights, b)
  bld.table_bytes = weights * b
  bld.fsdp(weights, G, "expert weights over fsdp (FSDP)", placed=True)
  bld.add(
    "dispatch: sort the group's pairs", cost.RADIX_PASSES * pairs_all * cost.RADIX_BYTES_PER_PAIR * 2, 0, forward=True
  )
  bld.add("dispatch: gather x rows of every pair", 2 * pairs_all * D * b, 0, forward=True)
  bld.matmul("experts: gate and up (grouped)", pairs, D, 2 * F, b, b, cost.F32)  # the two [D, F] weights side by side
  bld.add("experts: swish(gate) * up", 2 * pairs * F * cost.F32 + pairs * F * b, 4 * pairs * F, forward=True)
  bld.add(
    "experts: swish(gate) * up backward", 2 * pairs * F * cost.F32 + pairs * F * b + 2 * pairs * F * b, 8 * pairs * F
  )
  bld.matmul("experts: down (grouped)", pairs, F, D, b, b, cost.F32)
  bld.add(
    "combine: unpermute and weight",
    2 * pairs_all * D * cost.F32 + pairs_all * D * cost.F32 + pairs_all * cost.F32 + N * D * b,
    2 * pairs_all * D,
    forward=True,
  )
  bld.add("combine backward", N * D * b + pairs_all * cost.F32 + 3 * pairs_all * D * cost.F32, 2 * pairs_all * D)
  bld.add("dispatch backward: scatter-add dx rows", pairs_all * D * b + N * D * b, pairs_all * D)
  router = D * X + X
  bld.optimizer(bld.tables(weights / G, devices // (E * G)) + router)
  bld.grad_sync(router, devices)
  S = _shared_width(ffn)
  if S:  # the shared experts: a dense SwiGLU of S on the device's own tokens, laid out as the dense layers
    shared = 3 * D * S
    bld.cast(shared, b)
    bld.fsdp(shared, G, "shared experts over fsdp (FSDP)")
    bld.matmul("shared experts: gate and up", n, D, 2 * S, b, b, b)
    bld.add("shared experts: swish(gate) * up", 3 * n * S * b, 4 * n * S, forward=True)
    bld.add("shared experts: swish(gate) * up backward", 5 * n * S * b, 8 * n * S)
    bld.matmul("shared experts: down", n, S, D, b, b, b)
    bld.optimizer(shared / G)
    bld.grad_sync(shared / G, devices // G)
  # moe_all_to_all.all_to_all_experts: ragged all-to-alls of the n k pairs' rows, in the compute dtype, each way
  tokens = functools.partial(bld.collective, placed=True)
  tokens("all-gather", E * X * cost.INDEX, E, "per-expert pair counts (sizes and offsets)", forward=True)
  tokens("all-to-all", pairs * D * b, E, "x rows to their experts' devices (ragged)", forward=True)
  tokens("all-to-all", pairs * D * b, E, "expert outputs back (ragged)", forward=True)
  tokens("all-to-all", pairs * D * b, E, "dy rows to the experts (ragged)")
  tokens("all-to-all", pairs * D * b, E, "dx rows back (ragged)")


SPEC = FfnSpec(
  name="moe",
  module=Moe,
  fields=(
    "d_ffw",
    "n_experts",
    "experts_per_token",
    "aux_loss",
    "router_z_loss",
    "bias_update_rate",
    "n_shared_experts",
    "router_scores",
  ),
  check=ffn_checks.check_moe,
  params=_params,
  flops=_flops,
  ladder_size=lambda d_model: dict(d_ffw=d_model),
  served_names=("expert_ids", "expert_weights"),
  torch_class="Moe",
  cost=moe_cost,
  # the experts' hidden, and the dispatch's sorted rows in and outputs out (k rows of D each)
  residual_bytes=lambda model, ffn, tokens, itemsize: (
    tokens * ffn.experts_per_token * (2 * ffn.d_ffw + 2 * model.d_model) * itemsize
  ),
  units=Units("expert", "n_experts", TABLE_AXES),
  circuit=Circuit("expert_ids", "expert_weights", size=lambda ffn: ffn.n_experts, block=None),
  usage_stats=_usage_stats,
  bias_loads=lambda ffn, counts_E: counts_E,  # one bias per expert
  routing_bytes=lambda ffn, tokens: tokens * ffn.experts_per_token * 2 * 4,  # each token's expert ids and weights
)

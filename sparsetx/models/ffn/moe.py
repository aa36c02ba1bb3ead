"""MoE as in GPT-OSS: a linear router (with bias), top-k experts per token, softmax over the k
selected logits as mixing weights, SwiGLU experts.

Dispatch is dropless and real: the (token, slot) pairs are sorted by expert and every expert runs
one grouped matmul (`jax.lax.ragged_dot`) over exactly the tokens routed to it. No expert sees a
token it was not chosen for, and no token is dropped for capacity.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from sparsetx.models.ffn.common import dense_init
from sparsetx.models.taps import tap


def dispatch_experts(x_ND, expert_ids_NK, weights_NK, wi_gate_EDF, wi_up_EDF, wo_EFD):
  """sum_k weights[n, k] * SwiGLU_{expert_ids[n, k]}(x[n]), computing only the routed pairs."""
  N, K = expert_ids_NK.shape
  E = wi_gate_EDF.shape[0]
  expert_of_slot = expert_ids_NK.reshape(N * K)
  order = jnp.argsort(expert_of_slot, stable=True)
  group_sizes_E = jnp.bincount(expert_of_slot, length=E).astype(jnp.int32)
  x_SD = x_ND[order // K]
  dtype = x_ND.dtype

  def grouped(lhs, rhs):
    return jax.lax.ragged_dot(lhs, rhs.astype(dtype), group_sizes_E, preferred_element_type=jnp.float32)

  h_SF = (jax.nn.silu(grouped(x_SD, wi_gate_EDF)) * grouped(x_SD, wi_up_EDF)).astype(dtype)
  y_SD = grouped(h_SF, wo_EFD)
  y_NKD = y_SD[jnp.argsort(order)].reshape(N, K, -1)
  return jnp.einsum("nkd,nk->nd", y_NKD, weights_NK.astype(jnp.float32)).astype(dtype)


class Moe(nn.Module):
  cfg: object  # the model config (FrozenConfigDict)

  @nn.compact
  def __call__(self, x_BTD):
    ffn = self.cfg.ffn
    E, K, F, D = ffn.n_experts, ffn.experts_per_token, ffn.d_ffw, self.cfg.d_model
    param_dtype = jnp.dtype(self.cfg.param_dtype)
    logits_BTE = nn.Dense(
        E,
        dtype=jnp.float32,
        param_dtype=param_dtype,
        kernel_init=dense_init(self.cfg.init_std, ("embed", None)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
        name="router",
    )(x_BTD.astype(jnp.float32))
    top_logits_BTK, expert_ids_BTK = jax.lax.top_k(logits_BTE, K)
    weights_BTK = jax.nn.softmax(top_logits_BTK, axis=-1)
    expert_ids_BTK = tap(self, "expert_ids", expert_ids_BTK)
    weights_BTK = tap(self, "expert_weights", weights_BTK)

    def table(name, shape, names):
      return self.param(name, nn.with_logical_partitioning(nn.initializers.normal(self.cfg.init_std), names), shape, param_dtype)

    wi_gate = table("wi_gate", (E, D, F), ("expert", "embed", "mlp"))
    wi_up = table("wi_up", (E, D, F), ("expert", "embed", "mlp"))
    wo = table("wo", (E, F, D), ("expert", "mlp", "embed"))
    B, T, _ = x_BTD.shape
    y_ND = dispatch_experts(
        x_BTD.reshape(B * T, D), expert_ids_BTK.reshape(B * T, K), weights_BTK.reshape(B * T, K), wi_gate, wi_up, wo
    )
    return y_ND.reshape(B, T, D)

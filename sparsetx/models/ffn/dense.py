"""Dense baselines: the GELU MLP and SwiGLU (d_model -> d_ffw -> d_model)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from sparsetx.config import ffn_checks
from sparsetx.models.ffn.common import dense_init, gelu
from sparsetx.models.ffn.spec import FfnSpec, dense_width
from sparsetx.models.taps import tap


def projection(cfg, features: int, names: tuple, name: str) -> nn.Dense:
  return nn.Dense(
    features,
    use_bias=cfg.use_bias,
    dtype=jnp.dtype(cfg.dtype),
    param_dtype=jnp.dtype(cfg.param_dtype),
    kernel_init=dense_init(cfg.init_std, names),
    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[-1:]),
    name=name,
  )


class Mlp(nn.Module):
  """y = W_out GELU(W_in x) (+ biases when cfg.use_bias, as in GPT-NeoX)."""

  cfg: object  # the model config (FrozenConfigDict)

  @nn.compact
  def __call__(self, x_BTD):
    h_BTF = gelu(projection(self.cfg, self.cfg.ffn.d_ffw, ("embed", "mlp"), "wi")(x_BTD))
    h_BTF = nn.with_logical_constraint(h_BTF, ("batch", "length", "mlp"))
    h_BTF = tap(self, "mlp_neurons", h_BTF)
    return projection(self.cfg, self.cfg.d_model, ("mlp", "embed"), "wo")(h_BTF)


class SwiGlu(nn.Module):
  """y = W_out (swish(W_gate x) * W_up x)."""

  cfg: object

  @nn.compact
  def __call__(self, x_BTD):
    gate_BTF = projection(self.cfg, self.cfg.ffn.d_ffw, ("embed", "mlp"), "wi_gate")(x_BTD)
    up_BTF = projection(self.cfg, self.cfg.ffn.d_ffw, ("embed", "mlp"), "wi_up")(x_BTD)
    h_BTF = nn.with_logical_constraint(jax.nn.silu(gate_BTF) * up_BTF, ("batch", "length", "mlp"))
    h_BTF = tap(self, "mlp_neurons", h_BTF)
    return projection(self.cfg, self.cfg.d_model, ("mlp", "embed"), "wo")(h_BTF)


def _mlp_params(model, ffn) -> tuple[int, int]:
  total = 2 * model.d_model * ffn.d_ffw + int(model.use_bias) * (ffn.d_ffw + model.d_model)
  return total, total


def _swiglu_params(model, ffn) -> tuple[int, int]:
  total = 3 * model.d_model * ffn.d_ffw + int(model.use_bias) * (2 * ffn.d_ffw + model.d_model)
  return total, total


def _dense_cost(ins, bld, model, ffn, n, E, G, b, devices):
  """MLP (GELU) and SwiGLU: matmuls on the own tokens, weights FSDP-gathered over G."""
  D, F = model.d_model, ffn.d_ffw
  weights = (ins + 1) * D * F
  bld.cast(weights, b)
  bld.table_bytes = weights * b
  bld.fsdp(weights, G, "weights over fsdp (FSDP)")
  bld.matmul("in projection" + ("s (gate, up)" if ins == 2 else ""), n, D, ins * F, b, b, b)
  bld.add("activation", (ins + 1) * n * F * b, 4 * n * F, forward=True)
  bld.add("activation backward", (2 * ins + 1) * n * F * b, 8 * n * F)
  bld.matmul("out projection", n, F, D, b, b, b)
  bld.optimizer(weights / G)
  bld.grad_sync(weights / G, devices // G)


MLP_SPEC = FfnSpec(
  name="mlp",
  module=Mlp,
  fields=("d_ffw",),
  check=ffn_checks.check_mlp,
  params=_mlp_params,
  flops=lambda model, ffn: 2 * 2 * model.d_model * ffn.d_ffw,
  ladder_size=lambda d_model: dict(d_ffw=dense_width(d_model)),
  served_names=("mlp_neurons",),
  torch_class="Mlp",
  cost=functools.partial(_dense_cost, 1),
  residual_bytes=lambda model, ffn, tokens, itemsize: tokens * ffn.d_ffw * 2 * itemsize,  # the hidden, pre and post
)
SWIGLU_SPEC = FfnSpec(
  name="swiglu",
  module=SwiGlu,
  fields=("d_ffw",),
  check=ffn_checks.check_swiglu,
  params=_swiglu_params,
  flops=lambda model, ffn: 2 * 3 * model.d_model * ffn.d_ffw,
  ladder_size=lambda d_model: dict(d_ffw=dense_width(d_model)),
  served_names=("mlp_neurons",),
  torch_class="SwiGlu",
  cost=functools.partial(_dense_cost, 2),
  residual_bytes=lambda model, ffn, tokens, itemsize: tokens * ffn.d_ffw * 3 * itemsize,  # gate, up, their product
)

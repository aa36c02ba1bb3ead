"""sgatlin: sparsely gated linear neurons (seed paper eq. 1-2, Appendix A, Listing 1).

More: docs/modules.md, sparsetx/models/ffn/sgatlin.py.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from sparsetx import scopes
from sparsetx.config import ffn_checks, n_keys_for
from sparsetx.config.placements import placement_of
from sparsetx.kernels.rows.gated_gather import options_from_config
from sparsetx.models.ffn import table_cost
from sparsetx.models.ffn.common import activation_for
from sparsetx.models.ffn.product_keys import make_router, subkey_loads
from sparsetx.models.ffn.spec import (
  Circuit,
  FfnSpec,
  Units,
  product_key_flops,
  product_key_params,
  product_key_routing_bytes,
  product_key_width,
  subkey_rows,
  subkey_window_stats,
)
from sparsetx.models.taps import tap
from sparsetx.parallel import own_tokens, sparse_forms, tables


def table_init(d_ffw: int):
  """Truncated normal with std 1/sqrt(d_ffw) over each (d_ffw, d_model) table, as the authors run it."""
  return nn.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=tuple(range(-4, -2))
  )


TABLE_AXES = (None, "channel", "neuron", "embed")  # experts [2, C, d_ffw, d_model]


class Sgatlin(nn.Module):
  cfg: object  # the model config (FrozenConfigDict)

  @nn.compact
  def __call__(self, x_BTD):
    ffn = self.cfg.ffn
    C, F, D = ffn.n_channels, ffn.d_ffw, self.cfg.d_model
    table = tables.NeuronTable(TABLE_AXES, "channel", C, placement_of(ffn))
    x_BTD = own_tokens.keep_on_token_shards(x_BTD, table)
    with jax.named_scope(scopes.ROUTER):
      scores_BTCK, idx_BTCK = make_router(ffn.router, ffn, jnp.dtype(self.cfg.param_dtype), (C, 2, n_keys_for(F)))(
        x_BTD
      )
    scores_BTCK = own_tokens.keep_on_token_shards(scores_BTCK, table)
    idx_BTCK = own_tokens.keep_on_token_shards(idx_BTCK, table)
    gates_BTCK = scores_BTCK if ffn.router == "product" else jax.nn.softmax(scores_BTCK, axis=-1)
    idx_BTCK = tap(self, "gate_indices", idx_BTCK)
    gates_BTCK = tap(self, "gate_scores", gates_BTCK)

    experts = tables.table_param(
      self,
      "experts",
      table_init(F),
      (2, C, F, D),
      jnp.dtype(self.cfg.param_dtype),
      TABLE_AXES,
      ("channel", "embed"),
      table.placement,
    )
    return sparse_forms.neuron_table_gather(
      table, x_BTD, experts, idx_BTCK, gates_BTCK, activation_for(ffn), options_from_config(ffn.get("kernel"))
    )


SPEC = FfnSpec(
  name="sgatlin",
  module=Sgatlin,
  fields=(
    "d_ffw",
    "n_channels",
    "top_k",
    "d_key",
    "activation",
    "gelu_approximate",
    "router",
    "kernel",
    "bias_update_rate",
  ),
  check=ffn_checks.check_sgatlin,
  params=lambda model, ffn: product_key_params(
    model, ffn, peer_router=ffn.router == "peer", table_rows=ffn.n_channels * ffn.d_ffw
  ),  # (+ the sub-keys' selection bias, C 2 sqrt(d_ffw), with bias_update_rate: product_key_params)
  flops=lambda model, ffn: product_key_flops(model, ffn, peer_router=ffn.router == "peer"),
  ladder_size=lambda d_model: dict(d_ffw=product_key_width(16, 12, d_model)),
  served_names=("gate_indices", "gate_scores", "gate_vector"),
  torch_class="Sgatlin",
  cost=table_cost.neuron_table_cost,
  residual_bytes=table_cost.residual_bytes,
  units=Units("channel", "n_channels", TABLE_AXES),
  neuron_table=TABLE_AXES,
  window_stats=subkey_window_stats,
  routing_bytes=product_key_routing_bytes,
  count_rows=subkey_rows,
  bias_loads=subkey_loads,  # per channel and half, per sub-key
  # Each channel owns its table: a unit is a (channel, neuron) pair.
  circuit=Circuit(
    "gate_indices", "gate_scores", size=lambda ffn: ffn.n_channels * ffn.d_ffw, block=lambda ffn: ffn.d_ffw
  ),
)

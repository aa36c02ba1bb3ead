"""PEER (He 2024): per-channel product-key routers over one shared table of single-neuron experts.

Differences from sgatlin, as the seed paper lists them: every channel has its own query, the
neuron table is shared by the channels, the neurons are GELU, and the k scores of a channel are
softmax-normalized. As the authors' code computes it, y = sum softmax(scores) * gelu(<w_in, x>) * w_out
(the gate outside the activation) with `jax.nn.gelu`'s default tanh approximation
(`ffn.gelu_approximate=False` gives the exact erf form). (PEER's query batch norm is not part of the baseline in the seed paper.)

More: docs/modules.md, sparsetx/models/ffn/peer.py.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from sparsetx import scopes
from sparsetx.config import ffn_checks, n_keys_for
from sparsetx.config.placements import placement_of
from sparsetx.kernels.rows.gated_gather import options_from_config
from sparsetx.models.ffn import table_cost
from sparsetx.models.ffn.common import gelu_for
from sparsetx.models.ffn.product_keys import make_router, subkey_loads
from sparsetx.models.ffn.spec import (
  Circuit,
  FfnSpec,
  product_key_flops,
  product_key_params,
  product_key_routing_bytes,
  product_key_width,
  subkey_rows,
  subkey_window_stats,
)
from sparsetx.models.taps import tap
from sparsetx.parallel import own_tokens, sparse_forms, tables

TABLE_AXES = (None, "neuron", "embed")  # experts [2, d_ffw, d_model], shared by the channels


class Peer(nn.Module):
  cfg: object  # the model config (FrozenConfigDict)

  @nn.compact
  def __call__(self, x_BTD):
    ffn = self.cfg.ffn
    F, D = ffn.d_ffw, self.cfg.d_model
    table = tables.NeuronTable(TABLE_AXES, None, 1, placement_of(ffn))
    x_BTD = own_tokens.keep_on_token_shards(x_BTD, table)
    with jax.named_scope(scopes.ROUTER):
      bias_shape = (2, n_keys_for(F))  # one bias per sub-key, shared by the channels as the table is
      scores_BTCK, idx_BTCK = make_router("peer", ffn, jnp.dtype(self.cfg.param_dtype), bias_shape)(x_BTD)
    scores_BTCK = own_tokens.keep_on_token_shards(scores_BTCK, table)
    idx_BTCK = own_tokens.keep_on_token_shards(idx_BTCK, table)
    gates_BTCK = jax.nn.softmax(scores_BTCK, axis=-1)
    idx_BTCK = tap(self, "gate_indices", idx_BTCK)
    gates_BTCK = tap(self, "gate_scores", gates_BTCK)

    experts = tables.table_param(
      self,
      "experts",
      nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)),
      (2, F, D),
      jnp.dtype(self.cfg.param_dtype),
      TABLE_AXES,
      ("embed",),  # the d-split's slices
      table.placement,
    )
    B, T = idx_BTCK.shape[:2]
    return sparse_forms.neuron_table_gather(
      table,
      x_BTD,
      experts[:, None],  # one unit: the channels share the table
      idx_BTCK.reshape(B, T, 1, -1),
      gates_BTCK.reshape(B, T, 1, -1),
      gelu_for(ffn),
      options_from_config(ffn.get("kernel")),
      gate_inside_activation=False,  # softmax scores times GELU'd neurons, as PEER's code
    )


SPEC = FfnSpec(
  name="peer",
  module=Peer,
  fields=("d_ffw", "n_channels", "top_k", "d_key", "gelu_approximate", "kernel", "bias_update_rate"),
  check=ffn_checks.check_peer,
  params=lambda model, ffn: product_key_params(model, ffn, peer_router=True, table_rows=ffn.d_ffw),
  flops=lambda model, ffn: product_key_flops(model, ffn, peer_router=True),
  ladder_size=lambda d_model: dict(d_ffw=product_key_width(32, 24, d_model)),
  served_names=("gate_indices", "gate_scores", "gate_vector"),
  torch_class="Peer",
  cost=functools.partial(table_cost.neuron_table_cost, shared=True),
  residual_bytes=table_cost.residual_bytes,
  neuron_table=TABLE_AXES,
  window_stats=subkey_window_stats,
  routing_bytes=product_key_routing_bytes,
  count_rows=subkey_rows,
  bias_loads=subkey_loads,  # the shared table's picks per sub-key of each half
  # Channels index one shared table: the circuit keeps (channel, neuron) apart, usage counts neurons.
  circuit=Circuit(
    "gate_indices",
    "gate_scores",
    size=lambda ffn: ffn.n_channels * ffn.d_ffw,
    block=lambda ffn: ffn.d_ffw,
    usage_size=lambda ffn: ffn.d_ffw,
  ),
)

"""PEER (He 2024): per-channel product-key routers over one shared table of single-neuron experts.

Differences from sgatlin, as the seed paper lists them: every channel has its own query, the
neuron table is shared by the channels, the neurons are GELU, and the k scores of a channel are
softmax-normalized. As the authors' code computes it, y = sum softmax(scores) * gelu(<w_in, x>) * w_out
(the gate outside the activation) with `jax.nn.gelu`'s default tanh approximation
(`ffn.gelu_approximate=False` gives the exact erf form). (PEER's query batch norm is not part of the baseline in the seed paper.)

Expert parallelism (see sparsetx/parallel/expert_parallel.py): the one table is shared by the
channels, so it cannot be split by channel; it is split by d_model instead, over the mesh axes the
rules give its `embed` axis (`fsdp` by default; map `embed` to ("fsdp", "expert") to spread it over
the expert axis too). S devices of such a d-group each hold experts[:, :, d-slice] and never send
it; one shard_map (`split_gated_gather`) moves tokens. The router runs where the tokens are. Bytes a
device sends per own token and layer, b bytes per activation, S the d-group size when it also
splits the batch, C*k the picks per token: forward (S-1)/S*D*b (x all-to-all by d-slice) +
(S-1)*C*k*8 (int32 index and f32 gate, all-gathered) + 2*(S-1)*C*k*4 (all-reduce of the float32
partial dots) + (S-1)/S*D*b (y all-to-all back); backward the same again: (S-1)/S*D*b (dy) +
2*(S-1)*C*k*4 (dot gradients) + (S-1)/S*D*b (dx) + (S-1)*C*k*4 (gate gradients, reduce-scattered).
Work and table bytes per device are 1/S whatever the routing.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from sparsetx.config import ffn_checks
from sparsetx.kernels.gated_gather import gated_gather, options_from_config
from sparsetx.models.ffn.common import gelu_for
from sparsetx.models.ffn.product_keys import make_router
from sparsetx.models.ffn.spec import Circuit, FfnSpec, product_key_flops, product_key_params, product_key_width
from sparsetx.models.taps import tap
from sparsetx.parallel import expert_parallel as ep

TABLE_AXES = (None, "neuron", "embed")  # experts [2, d_ffw, d_model], shared by the channels


class Peer(nn.Module):
  cfg: object  # the model config (FrozenConfigDict)

  @nn.compact
  def __call__(self, x_BTD):
    ffn = self.cfg.ffn
    N, D = ffn.d_ffw, self.cfg.d_model
    group = ep.table_group(TABLE_AXES, None, 1, x_BTD.shape[0] * x_BTD.shape[1], "config.model.ffn")
    if group is not None:
      x_BTD = ep.on_token_shards(x_BTD, group)
    scores_BTCK, idx_BTCK = make_router("peer", ffn, jnp.dtype(self.cfg.param_dtype))(x_BTD)
    if group is not None:
      scores_BTCK, idx_BTCK = ep.on_token_shards(scores_BTCK, group), ep.on_token_shards(idx_BTCK, group)
    gates_BTCK = jax.nn.softmax(scores_BTCK, axis=-1)
    idx_BTCK = tap(self, "gate_indices", idx_BTCK)
    gates_BTCK = tap(self, "gate_scores", gates_BTCK)

    experts = self.param(
      "experts",
      nn.with_logical_partitioning(
        nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)),
        TABLE_AXES,
      ),
      (2, N, D),
      jnp.dtype(self.cfg.param_dtype),
    )
    B, T = idx_BTCK.shape[:2]
    if group is not None:
      y_ND = ep.split_gated_gather(
        group,
        x_BTD.reshape(B * T, D),
        experts[:, None],
        idx_BTCK.reshape(B * T, 1, -1),
        gates_BTCK.reshape(B * T, 1, -1),
        gelu_for(ffn),
        options_from_config(ffn.get("kernel")),
        gate_inside_activation=False,
      )
      return y_ND.reshape(B, T, D)
    return gated_gather(
      x_BTD,
      experts[0],
      experts[1],
      idx_BTCK.reshape(B, T, -1),
      gates_BTCK.reshape(B, T, -1),
      gelu_for(ffn),
      options=options_from_config(ffn.get("kernel")),
      gate_inside_activation=False,  # softmax scores times GELU'd neurons, as PEER's code
    )


SPEC = FfnSpec(
  name="peer",
  module=Peer,
  fields=("d_ffw", "n_channels", "top_k", "d_key", "gelu_approximate", "kernel"),
  check=ffn_checks.check_peer,
  params=lambda model, ffn: product_key_params(model, ffn, peer_router=True, table_rows=ffn.d_ffw),
  flops=lambda model, ffn: product_key_flops(model, ffn, peer_router=True),
  ladder_size=lambda d_model: dict(d_ffw=product_key_width(32, 24, d_model)),
  served_names=("gate_indices", "gate_scores", "gate_vector"),
  torch_class="Peer",
  neuron_table=TABLE_AXES,
  # Channels index one shared table: the circuit keeps (channel, neuron) apart, usage counts neurons.
  circuit=Circuit(
    "gate_indices",
    "gate_scores",
    size=lambda ffn: ffn.n_channels * ffn.d_ffw,
    block=lambda ffn: ffn.d_ffw,
    usage_size=lambda ffn: ffn.d_ffw,
  ),
)

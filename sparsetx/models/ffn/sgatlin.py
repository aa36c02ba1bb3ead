"""sgatlin: sparsely gated linear neurons (seed paper eq. 1-2, Appendix A, Listing 1).

Per channel c a product-key gate picks exactly k of d_ffw rank-one neurons;
out = sum_c sum_{i in topk_c} g_{c,i} * w_out_{c,i} * <w_in_{c,i}, z>. The gates are the raw summed
product-key scores (no softmax, no scaling) and nothing is nonlinear but the top-k itself. Options
for the paper's ablations (Table 1): an activation (`ffn.activation`: relu | gelu | swish) applied as
the authors' code applies it, to the gated pre-activation, act(g_{c,i} * <w_in_{c,i}, z>), with GELU in
`jax.nn.gelu`'s default tanh form unless `ffn.gelu_approximate=False`; and PEER's router (per-channel
query and a softmax over the k scores) in place of the shared-query product keys.

Expert parallelism (a mesh in the context whose `channel` axes have size E > 1, see
sparsetx/parallel/expert_parallel.py): the table is split by channel, C/E channels per device,
and one shard_map moves tokens, not tables. The router runs where the tokens are (batch-sharded).
Each device all-gathers the tokens of its expert group (x, D values each), receives by all-to-all
only its channels' indices and gates, runs the gated gather over its C/E channels, and
reduce-scatters the [tokens, D] partial sums back to the tokens' owners. Each channel takes
exactly k rows per token, so the work is balanced whatever the routing. Bytes a device sends per
own token and layer, b bytes per activation (2 for bf16), E the expert-axis size when it also
splits the batch: forward (E-1)*D*b (x all-gather) + (E-1)/E*C*k*8 (int32 index and f32 gate,
all-to-all) + (E-1)*D*4 (y reduce-scatter, summed in float32); backward (E-1)*D*4 (dy all-gather)
+ (E-1)*D*4 (dx reduce-scatter, float32) + (E-1)/E*C*k*4 (gate gradients).

When the rules also split the table's d_model (its `embed` axis: `fsdp`, or ("fsdp", "expert") when
the expert axis is larger than C and channels cannot be split over it), each device holds
rows[:, c-block, :, d-slice] and the layer still moves only tokens: `split_gated_gather` adds,
over the S devices of a d-group, an all-to-all of x and y by d-slice and an all-reduce of the
float32 partial dots <w_in[c, i, d-slice], x[d-slice]> (the sum comes before the activation and
the gate). Extra bytes per own token, E the channel-split size, S the d-group size, both also
splitting the batch: forward E*(S-1)/S*D*b (x) + (S-1)*C*k*8 (indices and gates) + 2*(S-1)*C*k*4
(partial dots) + E*(S-1)/S*D*4 (y, float32 partial sums over channels); backward the same for dy,
the dot gradients and dx, and (S-1)*C*k*4 for the gate gradients. Its local work is the xla
path's (token-chunked gathers of the picked row slices, sorted-segment table gradients); the
Pallas kernels have no partial-dot entry point yet.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparsetx.config import ffn_checks
from sparsetx.kernels.gated_gather import gated_gather, options_from_config
from sparsetx.models.ffn.common import activation_for
from sparsetx.models.ffn.product_keys import make_router
from sparsetx.models.ffn.spec import (
  Circuit,
  FfnSpec,
  Units,
  product_key_flops,
  product_key_params,
  product_key_width,
)
from sparsetx.models.taps import tap
from sparsetx.parallel import expert_parallel as ep


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
    C, N, D = ffn.n_channels, ffn.d_ffw, self.cfg.d_model
    group = ep.table_group(TABLE_AXES, "channel", C, x_BTD.shape[0] * x_BTD.shape[1], "config.model.ffn.n_channels")
    if group is not None:
      x_BTD = ep.on_token_shards(x_BTD, group)
    scores_BTCK, idx_BTCK = make_router(ffn.router, ffn, jnp.dtype(self.cfg.param_dtype))(x_BTD)
    if group is not None:
      scores_BTCK, idx_BTCK = ep.on_token_shards(scores_BTCK, group), ep.on_token_shards(idx_BTCK, group)
    gates_BTCK = scores_BTCK if ffn.router == "product" else jax.nn.softmax(scores_BTCK, axis=-1)
    idx_BTCK = tap(self, "gate_indices", idx_BTCK)
    gates_BTCK = tap(self, "gate_scores", gates_BTCK)

    experts = self.param(
      "experts",
      nn.with_logical_partitioning(table_init(N), TABLE_AXES),
      (2, C, N, D),
      jnp.dtype(self.cfg.param_dtype),
    )
    B, T = idx_BTCK.shape[:2]
    if group is not None and group.split:
      y_ND = ep.split_gated_gather(
        group,
        x_BTD.reshape(B * T, D),
        experts,
        idx_BTCK.reshape(B * T, C, -1),
        gates_BTCK.reshape(B * T, C, -1),
        activation_for(ffn),
        options_from_config(ffn.get("kernel")),
      )
      return y_ND.reshape(B, T, D)
    if group is not None:
      return _expert_parallel(group, x_BTD, experts, idx_BTCK, gates_BTCK, ffn)
    rows_BTS = (idx_BTCK + N * jnp.arange(C, dtype=idx_BTCK.dtype)[None, None, :, None]).reshape(B, T, C * ffn.top_k)
    return gated_gather(
      x_BTD,
      experts[0].reshape(C * N, D),
      experts[1].reshape(C * N, D),
      rows_BTS,
      gates_BTCK.reshape(B, T, -1),
      activation_for(ffn),
      options=options_from_config(ffn.get("kernel")),
    )


def _expert_parallel(group, x_BTD, experts_2CND, idx_BTCK, gates_BTCK, ffn):
  """The layer with channels split over the expert group (the module docstring has the pattern)."""
  B, T, D = x_BTD.shape
  C, N, K = ffn.n_channels, ffn.d_ffw, ffn.top_k
  options = options_from_config(ffn.get("kernel"))

  def local(x_nD, experts_2cND, idx_nCK, gates_nCK):
    c = experts_2cND.shape[1]
    x_gD = ep.gather_tokens(x_nD, group)
    idx_gcK = ep.to_owners(idx_nCK, group, unit_dim=1)
    gates_gcK = ep.to_owners(gates_nCK, group, unit_dim=1)
    rows_gS = (idx_gcK + N * jnp.arange(c, dtype=idx_gcK.dtype)[None, :, None]).reshape(-1, c * K)
    y_gD = gated_gather(
      x_gD,
      experts_2cND[0].reshape(c * N, D),
      experts_2cND[1].reshape(c * N, D),
      rows_gS,
      gates_gcK.reshape(rows_gS.shape),
      activation_for(ffn),
      options=options,
    )
    return ep.scatter_back(y_gD, group)

  tokens = group.token_spec
  y_ND = ep.shard_map(
    local,
    group,
    in_specs=(tokens, P(None, group.unit_spec), tokens, tokens),
    out_specs=tokens,
  )(x_BTD.reshape(B * T, D), experts_2CND, idx_BTCK.reshape(B * T, C, K), gates_BTCK.reshape(B * T, C, K))
  return y_ND.reshape(B, T, D).astype(x_BTD.dtype)


SPEC = FfnSpec(
  name="sgatlin",
  module=Sgatlin,
  fields=("d_ffw", "n_channels", "top_k", "d_key", "activation", "gelu_approximate", "router", "kernel"),
  check=ffn_checks.check_sgatlin,
  params=lambda model, ffn: product_key_params(
    model, ffn, peer_router=ffn.router == "peer", table_rows=ffn.n_channels * ffn.d_ffw
  ),
  flops=lambda model, ffn: product_key_flops(model, ffn, peer_router=ffn.router == "peer"),
  ladder_size=lambda d_model: dict(d_ffw=product_key_width(16, 12, d_model)),
  served_names=("gate_indices", "gate_scores", "gate_vector"),
  torch_class="Sgatlin",
  units=Units("channel", "n_channels", TABLE_AXES),
  neuron_table=TABLE_AXES,
  # Each channel owns its table: a unit is a (channel, neuron) pair.
  circuit=Circuit(
    "gate_indices", "gate_scores", size=lambda ffn: ffn.n_channels * ffn.d_ffw, block=lambda ffn: ffn.d_ffw
  ),
)

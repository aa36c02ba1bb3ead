"""PEER (He 2024): per-channel product-key routers over one shared table of single-neuron experts.

Differences from sgatlin, as the seed paper lists them: every channel has its own query, the
neuron table is shared by the channels, the neurons are GELU, and the k scores of a channel are
softmax-normalized. (PEER's query batch norm is not part of the baseline in the seed paper.)
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from sparsetx.kernels.gated_gather import gated_gather, options_from_config
from sparsetx.models.taps import tap
from sparsetx.models.ffn.common import gelu
from sparsetx.models.ffn.product_keys import make_router


class Peer(nn.Module):
  cfg: object  # the model config (FrozenConfigDict)

  @nn.compact
  def __call__(self, x_BTD):
    ffn = self.cfg.ffn
    N, D = ffn.d_ffw, self.cfg.d_model
    scores_BTCK, idx_BTCK = make_router("peer", ffn, jnp.dtype(self.cfg.param_dtype))(x_BTD)
    gates_BTCK = jax.nn.softmax(scores_BTCK, axis=-1)
    idx_BTCK = tap(self, "gate_indices", idx_BTCK)
    gates_BTCK = tap(self, "gate_scores", gates_BTCK)

    experts = self.param(
        "experts",
        nn.with_logical_partitioning(
            nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)),
            (None, "neuron", "embed"),
        ),
        (2, N, D),
        jnp.dtype(self.cfg.param_dtype),
    )
    B, T = idx_BTCK.shape[:2]
    return gated_gather(
        x_BTD,
        experts[0],
        experts[1],
        idx_BTCK.reshape(B, T, -1),
        gates_BTCK.reshape(B, T, -1),
        gelu,
        options=options_from_config(ffn.get("kernel")),
    )

"""sgatlin: sparsely gated linear neurons (seed paper eq. 1-2, Appendix A, Listing 1).

Per channel c a product-key gate picks exactly k of d_ffw rank-one neurons;
out = sum_c sum_{i in topk_c} g_{c,i} * w_out_{c,i} * <w_in_{c,i}, z>. The gates are the raw summed
product-key scores (no softmax, no scaling) and nothing is nonlinear but the top-k itself. Options
for the paper's ablations: an activation on <w_in, z>, and PEER's router (per-channel query and a
softmax over the k scores) in place of the shared-query product keys.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from sparsetx.kernels.gated_gather import gated_gather, options_from_config
from sparsetx.models.taps import tap
from sparsetx.models.ffn.common import ACTIVATIONS
from sparsetx.models.ffn.product_keys import make_router


def table_init(d_ffw: int):
  """Truncated normal with std 1/sqrt(d_ffw) over each (d_ffw, d_model) table, as the authors run it."""
  return nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=tuple(range(-4, -2))
  )


class Sgatlin(nn.Module):
  cfg: object  # the model config (FrozenConfigDict)

  @nn.compact
  def __call__(self, x_BTD):
    ffn = self.cfg.ffn
    C, N, D = ffn.n_channels, ffn.d_ffw, self.cfg.d_model
    scores_BTCK, idx_BTCK = make_router(ffn.router, ffn, jnp.dtype(self.cfg.param_dtype))(x_BTD)
    gates_BTCK = scores_BTCK if ffn.router == "product" else jax.nn.softmax(scores_BTCK, axis=-1)
    idx_BTCK = tap(self, "gate_indices", idx_BTCK)
    gates_BTCK = tap(self, "gate_scores", gates_BTCK)

    experts = self.param(
        "experts",
        nn.with_logical_partitioning(table_init(N), (None, "channel", "neuron", "embed")),
        (2, C, N, D),
        jnp.dtype(self.cfg.param_dtype),
    )
    B, T = idx_BTCK.shape[:2]
    rows_BTS = (idx_BTCK + N * jnp.arange(C, dtype=idx_BTCK.dtype)[:, None]).reshape(B, T, C * ffn.top_k)
    return gated_gather(
        x_BTD,
        experts[0].reshape(C * N, D),
        experts[1].reshape(C * N, D),
        rows_BTS,
        gates_BTCK.reshape(B, T, -1),
        ACTIVATIONS[ffn.activation],
        options=options_from_config(ffn.get("kernel")),
    )

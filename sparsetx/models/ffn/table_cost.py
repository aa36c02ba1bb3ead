"""The step cost of a product-key neuron table (sgatlin, PEER): its router, the gated gather over the device's rows
and the expert-parallel collectives, in sparsetx.perf.cost's terms (docs/cost_model.md derives the bytes)."""

import functools
import math

from sparsetx.perf import cost


def candidate_pairs(k: int) -> int:
  """Stage two's candidates: ranks (i, j) of the halves' top-k with (i + 1)(j + 1) <= k (product_keys.py)."""
  return sum(1 for i in range(k) for j in range(k) if (i + 1) * (j + 1) <= k)


def router_cost(bld: cost.CostBuilder, n, D, C, n_keys, k, d_key, b, peer: bool):
  """The router on the own tokens, float32: query, both halves' scores, the two top-k stages, their backward."""
  if peer:  # a query per channel, halves of d_key / 2 scored against per-channel sub-keys
    bld.matmul("router query", n, D, C * d_key, b, cost.F32, cost.F32, forward_runs=True)
    bld.add(
      "router sub-key scores",
      C * (n * d_key * cost.F32 + 2 * n_keys * (d_key // 2) * cost.F32 + n * 2 * n_keys * cost.F32),
      2 * n * C * 2 * n_keys * (d_key // 2),
      forward=True,
      dot=True,
    )
    bld.add(
      "router sub-key scores backward",
      2 * C * (n * d_key * cost.F32 + 2 * n_keys * (d_key // 2) * cost.F32 + n * 2 * n_keys * cost.F32),
      4 * n * C * 2 * n_keys * (d_key // 2),
    )
  else:  # one shared query, 2 key halves per channel
    bld.matmul("router query", n, D, d_key, b, cost.F32, cost.F32)
    bld.matmul("router key scores", n, d_key, 2 * C * n_keys, cost.F32, cost.F32, cost.F32)
  scores = n * 2 * C * n_keys
  bld.add(
    "router top-k stage 1",
    scores * cost.F32 + n * 2 * C * k * (cost.F32 + cost.INDEX),
    scores * cost.TOP_K_OPS_PER_SCORE,
    forward=True,
  )
  candidates = candidate_pairs(k)
  bld.add(
    "router top-k stage 2",
    n * C * 2 * k * (cost.F32 + cost.INDEX) + n * C * k * (cost.F32 + cost.INDEX),
    n * C * candidates * (1 + k),
    forward=True,
  )
  bld.add("router scores backward (scatter into halves)", scores * cost.F32 + n * C * k * (cost.F32 + cost.INDEX), 0)


def neuron_table_cost(bld, model, ffn, n, E, G, b, devices, shared=False):
  """sgatlin and PEER (`shared`: one table for all channels): product-key router, gated gather over the device's rows, the expert-parallel collectives."""
  D, C, k, F = model.d_model, ffn.n_channels, ffn.top_k, ffn.d_ffw
  peer = shared or ffn.get("router", "product") == "peer"
  n_keys = math.isqrt(F)
  router_cost(bld, n, D, C, n_keys, k, ffn.d_key, b, peer)
  c = 1 if shared else C // E  # tables on this device (PEER's is shared by the channels)
  R, d = c * F, D // G
  N, S = n * E * G, (C // E) * k
  bld.cast(2 * R * d, b)
  bld.table_bytes = 2 * R * d * b
  cost.gather_kernels(bld, N, S, d, b, R, segment_chunk=ffn.kernel.get("segment_chunk", 0))
  if peer:  # per-channel queries and sub-keys, split with the channels
    replicated, split = 0, (C * D * ffn.d_key + C * n_keys * ffn.d_key) // E
  else:  # the shared query everywhere, the keys split with the channels
    replicated, split = D * ffn.d_key, ffn.d_key * 2 * C * n_keys // E
  bld.optimizer(bld.tables(2 * R * d, devices // (E * G)) + replicated + split)
  bld.grad_sync(replicated, devices)
  bld.grad_sync(split, devices // E)
  # Unit split (docs/expert_parallel.md): tokens all-gathered, indices and gates to the owners, y reduce-scattered.
  tokens = functools.partial(bld.collective, placed=True)
  tokens("all-gather", n * E * D * b, E, "x to the expert group", forward=True)
  tokens("all-to-all", n * C * k * (cost.INDEX + cost.F32), E, "indices and gates to owners", forward=True)
  tokens("reduce-scatter", n * D * cost.F32, E, "y partial sums (float32)", forward=True)
  if (
    G == 1
  ):  # y cast to b by the reduce-scatter (expert_collectives.scatter_back): its dy holds b values and moves in b
    tokens("all-gather", n * E * D * b, E, "dy to the expert group")
  else:
    tokens("all-gather", n * E * D * cost.F32, E, "dy to the expert group (float32)")
  tokens("reduce-scatter", n * D * cost.F32, E, "dx partial sums (float32)")
  tokens("all-to-all", n * C * k * cost.F32, E, "gate gradients back")
  # d-split (G > 1): x by d-slice, indices and gates all-gathered, partial dots all-reduced, y back.
  y_bytes = b if shared else cost.F32
  tokens("all-to-all", n * E * D * b, G, "x d-slices to the d-group", forward=True)
  tokens("all-gather", G * n * C * k * (cost.INDEX + cost.F32), G, "indices and gates over the d-group", forward=True)
  tokens("all-reduce", G * n * C * k * cost.F32, G, "partial dots", forward=True)
  tokens("all-to-all", n * E * D * y_bytes, G, "y d-slices back", forward=True)
  tokens("all-to-all", n * E * D * b, G, "dy d-slices")
  tokens("all-reduce", G * n * C * k * cost.F32, G, "partial dot gradients")
  tokens("all-to-all", n * E * D * y_bytes, G, "dx d-slices back")
  tokens("reduce-scatter", n * C * k * cost.F32, G, "gate gradients")


def residual_bytes(model, ffn, tokens, itemsize) -> int:
  """The selected slots' scores and indices (float32, int32), the gated pre-activations, and the router's scores of
  both halves (float32), per token."""
  router = 2 * ffn.n_channels * math.isqrt(ffn.d_ffw) * cost.F32
  return tokens * (ffn.n_channels * ffn.top_k * (cost.F32 + cost.INDEX + itemsize) + router)

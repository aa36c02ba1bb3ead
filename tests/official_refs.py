"""The papers' layers as their authors' code writes them: independent references for the tests.

Nothing here imports sparsetx; each function is a transcription, line by line, of a published formula:

- sgatlin: the seed paper's Listing 1 (`SparselyGatedLinear`, product-key router): gather the picked rows,
  `z = einsum('btd,btckd->btck', x, w_in)`, `z = z * scores`, then for the Table 1 ablations the
  activation on the gated value (`z = act(z)`, the authors' code; `jax.nn.gelu` called with its default,
  the tanh approximation), `einsum('btck,btckd->btd', z, w_out)`. The router's `product_key_top_k` is
  written here as what it must equal: top-k over all n_keys**2 sums s1[i] + s2[j] (ties: lower index,
  `jax.lax.top_k`'s rule), index i * n_keys + j.
- PEER (He 2024, "Mixture of A Million Experts", its authors' JAX code as the seed paper runs it): per
  channel ("head") a query split in two halves scores two sub-key sets; top-k of the product keys;
  `softmax` over the k scores; the neurons are `jax.nn.gelu` (default tanh form) of
  `einsum('btd,bthkd->bthk', x, w_down)`, multiplied by the softmax scores, then
  `einsum('bthk,bthkd->btd', h, w_up)`: the gate outside the activation.
- FFF (the FFF seed paper, eq. for y and FFF^post, and UltraFastBERT's layer): a per-token NumPy walk in
  float64 down each of P heap-ordered trees, child 2n+2 if z > 0 else 2n+1 (z == 0 goes left), exact
  erf GELU (torch's default `nn.GELU`), y = b_out + sum GELU(z) w_out, or GELU(b_out + sum z w_out).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

OFFICIAL_GELU = jax.nn.gelu  # the default form, approximate=True, as both authors' codes call it
ACTIVATIONS = {"identity": lambda z: z, "relu": jax.nn.relu, "gelu": OFFICIAL_GELU, "swish": jax.nn.swish}
HI = jax.lax.Precision.HIGHEST


def product_key_top_k(s1_NK, s2_NK, k):
  """(scores, indices) [..., k]: top-k over every s1[i] + s2[j], index i * n_keys + j."""
  sums = (s1_NK[..., :, None] + s2_NK[..., None, :]).reshape(s1_NK.shape[:-1] + (-1,))
  return jax.lax.top_k(sums, k)


def sgatlin_from_routing(x_BTD, experts_2CND, scores_BTCK, indices_BTCK, act):
  """Listing 1 from `w_in, w_out = experts[indices]` on; `act` after the gate (Table 1's ablation)."""
  channel = jnp.arange(experts_2CND.shape[1])[:, None]
  w_in_BTCKD = experts_2CND[0][channel, indices_BTCK]
  w_out_BTCKD = experts_2CND[1][channel, indices_BTCK]
  z = jnp.einsum("btd,btckd->btck", x_BTD, w_in_BTCKD, precision=HI)
  z = z * scores_BTCK
  z = act(z)
  return jnp.einsum("btck,btckd->btd", z, w_out_BTCKD, precision=HI)


def sgatlin(params, x_BTD, k, act):
  """The sgatlin layer with its product-key router (query shared by the channels), from its params."""
  queries = jnp.einsum("btd,dq->btq", x_BTD, params["router"]["query"]["kernel"], precision=HI)
  similar_BT2CN = jnp.einsum("btq,qscn->btscn", queries, params["router"]["keys"]["kernel"], precision=HI)
  scores, indices = product_key_top_k(similar_BT2CN[:, :, 0], similar_BT2CN[:, :, 1], k)
  return sgatlin_from_routing(x_BTD, params["experts"], scores, indices, act)


def peer_router(params, x_BTD, k):
  """PEER's router: per channel a query in two halves against two sub-key sets; (raw top-k scores, indices)."""
  q_BTC2H = jnp.einsum("btd,dcsh->btcsh", x_BTD, params["router"]["query"]["kernel"], precision=HI)
  s_BTC2N = jnp.einsum("btcsh,csnh->btcsn", q_BTC2H, params["router"]["sub_keys"], precision=HI)
  return product_key_top_k(s_BTC2N[..., 0, :], s_BTC2N[..., 1, :], k)


def peer_from_routing(x_BTD, experts_2ND, scores_BTHK, indices_BTHK, act=OFFICIAL_GELU):
  """PEER's expert computation: softmax(scores) * gelu(<w_down, x>), summed with w_up."""
  w_down_BTHKD, w_up_BTHKD = experts_2ND[0][indices_BTHK], experts_2ND[1][indices_BTHK]
  h = jnp.einsum("btd,bthkd->bthk", x_BTD, w_down_BTHKD, precision=HI)
  h = act(h)
  h = h * jax.nn.softmax(scores_BTHK, axis=-1)
  return jnp.einsum("bthk,bthkd->btd", h, w_up_BTHKD, precision=HI)


def peer(params, x_BTD, k, act=OFFICIAL_GELU):
  scores, indices = peer_router(params, x_BTD, k)
  return peer_from_routing(x_BTD, params["experts"], scores, indices, act)


def sgatlin_peer_router(params, x_BTD, k, act):
  """sgatlin's ablation with PEER's router: per-channel tables, softmax gates, act after the gate (Listing 1)."""
  scores, indices = peer_router(params, x_BTD, k)
  return sgatlin_from_routing(x_BTD, params["experts"], jax.nn.softmax(scores, axis=-1), indices, act)


def _gelu_exact(z):
  return 0.5 * z * (1.0 + math.erf(z / math.sqrt(2.0)))


def fff_walk(x_ND, w_in_PMD, b_in_PM, w_out_PMD, b_out_D, depth, variant="fff"):
  """(y [N, D], path [N, P, depth + 1]) in float64, one token and one tree at a time."""
  x_ND, w_in_PMD, b_in_PM, w_out_PMD, b_out_D = (
    np.asarray(a, np.float64) for a in (x_ND, w_in_PMD, b_in_PM, w_out_PMD, b_out_D)
  )
  n_tokens, n_trees = x_ND.shape[0], w_in_PMD.shape[0]
  y_ND = np.zeros(x_ND.shape)
  path = np.zeros((n_tokens, n_trees, depth + 1), np.int64)
  for t in range(n_tokens):
    total = np.zeros(x_ND.shape[1])
    for p in range(n_trees):
      node = 0
      for level in range(depth + 1):
        path[t, p, level] = node
        z = float(x_ND[t] @ w_in_PMD[p, node]) + b_in_PM[p, node]
        total += (_gelu_exact(z) if variant == "fff" else z) * w_out_PMD[p, node]
        node = 2 * node + 2 if z > 0 else 2 * node + 1
    total = total + b_out_D
    y_ND[t] = total if variant == "fff" else np.vectorize(_gelu_exact)(total)
  return y_ND, path

"""Every backend of the gated gather, and the FFF layer, equal the authors' formulas (tests/official_refs.py).

sgatlin puts the gate inside its ablation activation, act(g * <w_in, x>); PEER outside, softmax(s) *
gelu(<w_in, x>); with GELU in jax.nn.gelu's default (tanh) form, as both authors' codes call it. Values and
the gradients to x, both tables and the gates (scores) are compared in float32: the same sums in another
order, so differences are float32 rounding (~1e-6 of the largest entry); the two GELU forms differ by
~1e-3 at |h| ~ 1 and the two gate orders by O(1), far outside the tolerances.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import official_refs as official
import pytest
from conftest import init_params, layer_model_config

from sparsetx.kernels import registry
from sparsetx.kernels.rows.gated_gather import KernelOptions, gated_gather
from sparsetx.models.ffn.common import gelu_tanh
from sparsetx.models.ffn.fff import Fff

ACTS = {"identity": lambda h: h, "relu": jax.nn.relu, "gelu": gelu_tanh, "swish": jax.nn.silu}
# Every row-kernel implementation in the registry (a new one is checked here without an edit), in interpret mode off
# its device, chosen by name; XLA also in its CPU row-sorted form. Mosaic GPU's interpret mode simulates TMA and
# barriers (~17 s a case here): its per-slot arithmetic between the row kernels is the XLA path's
# (reference.Gating), and test_kernels_pallas.py checks it against the XLA path with the gate inside a nonlinear
# activation, bias and two d_model chunks.
SLOW_INTERPRETERS = ("mosaic",)
BACKENDS = {
  "xla": KernelOptions("xla", token_chunk=4, pair_chunk=8, row_sorted=False),
  "xla_row_sorted": KernelOptions("xla", token_chunk=4, pair_chunk=8, row_sorted=True),
} | {
  i.name: registry.naming(i, KernelOptions(block_tokens=4, interpret=True))
  for i in registry.ROWS
  if i.name not in ("xla", *SLOW_INTERPRETERS)
}
B, T, C, K, N, D = 1, 7, 3, 2, 5, 32  # N neurons per channel: few, so rows repeat across tokens (and slots for PEER)


@pytest.fixture
def backend(request, monkeypatch):
  """The options of the backend named by the test id; a registry implementation is chosen by name (off its device
  the registry would not take it) by patching the dispatch."""
  name = request.param
  if name in {i.name for i in registry.ROWS} - {"xla"}:
    real = registry.resolve
    chosen = registry.by_name("rows", name)
    monkeypatch.setattr(
      registry,
      "rows",
      lambda options, key, call=None: chosen if options.implementation == name else real("rows", options, key, call),
    )
  return BACKENDS[name]


def routing_case(seed, n_units, shared_table):
  """x [B,T,D], experts [2,C,N,D] (or [2,N,D] shared), indices [B,T,C,K] with repeats, raw scores of both signs."""
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (B, T, D))
  table_shape = (2, N, D) if shared_table else (2, n_units, N, D)
  experts = jax.random.normal(k[1], table_shape) / D**0.5
  indices = jax.random.randint(k[2], (B, T, n_units, K), 0, N)
  scores = jax.random.normal(k[3], (B, T, n_units, K))
  return x, experts, indices, scores


def loss_and_grads(fn, x, experts, scores):
  """A loss weighting every output differently, and its gradients to x, the tables and the scores."""
  loss = lambda x, e, s: jnp.sum(jnp.sin(3.0 * fn(x, e, s)))  # noqa: E731
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, experts, scores)


def assert_close(got, want, rtol=2e-5, atol=2e-6):
  (loss_got, grads_got), (loss_want, grads_want) = got, want
  np.testing.assert_allclose(loss_got, loss_want, rtol=rtol, atol=atol * 10, err_msg="loss")
  for name, a, b in zip(("x", "experts", "scores"), grads_got, grads_want):
    scale = np.abs(np.asarray(b)).max()
    np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, rtol=rtol, atol=atol, err_msg=name)


@functools.cache
def sgatlin_official(activation):
  """Loss and gradients of Listing 1 on the sgatlin case (shared by the backends)."""
  _, x, experts, indices, scores = sgatlin_op(None, None)
  return loss_and_grads(
    lambda x, e, s: official.sgatlin_from_routing(x, e, s, indices, official.ACTIVATIONS[activation]),
    x,
    experts,
    scores,
  )


def sgatlin_op(act, options):
  def fn(x_BTD, experts_2CND, scores_BTCK):
    rows_BTS = (indices + N * jnp.arange(C)[None, None, :, None]).reshape(B, T, C * K)
    return gated_gather(
      x_BTD,
      experts_2CND[0].reshape(C * N, D),
      experts_2CND[1].reshape(C * N, D),
      rows_BTS,
      scores_BTCK.reshape(B, T, C * K),
      act,
      options=options,
    )

  x, experts, indices, scores = routing_case(0, C, shared_table=False)
  return fn, x, experts, indices, scores


# The designs (row order: the dots only; fused: the activation applied in the kernel like any elementwise one) take
# the identity and GELU; the kernels every activation.
SGATLIN_CASES = [
  (backend, activation)
  for backend in BACKENDS
  for activation in ACTS
  if not ("row_order" in backend or "fused" in backend) or activation in ("identity", "gelu")
]


@pytest.mark.parametrize("backend, activation", SGATLIN_CASES, indirect=["backend"])
def test_sgatlin_gate_inside_activation_equals_listing_1(backend, activation):
  """act(g * <w_in, x>) (official ablation order) in every backend, with raw scores of both signs."""

  fn, x, experts, indices, scores = sgatlin_op(ACTS[activation], backend)
  assert_close(loss_and_grads(fn, x, experts, scores), sgatlin_official(activation))


@pytest.mark.parametrize("backend", list(BACKENDS), indirect=True)
def test_peer_gate_outside_activation_equals_peer_code(backend):
  """softmax(s) * gelu(<w_in, x>) over one shared table (a token may pick a row in two heads) in every
  backend. PEER has no other activation: GELU in the tanh form of its code."""
  H = 4
  x, experts, indices, scores = routing_case(1, H, shared_table=True)
  repeats = sum(len(set(r)) < H * K for r in np.asarray(indices).reshape(B * T, H * K).tolist())
  assert repeats > 0  # the case exercises a row picked twice by one token

  def fn(x_BTD, experts_2ND, scores_BTHK):
    gates = jax.nn.softmax(scores_BTHK, axis=-1).reshape(B, T, H * K)
    return gated_gather(
      x_BTD,
      experts_2ND[0],
      experts_2ND[1],
      indices.reshape(B, T, H * K),
      gates,
      gelu_tanh,
      options=backend,
      gate_inside_activation=False,
    )

  want = loss_and_grads(lambda x, e, s: official.peer_from_routing(x, e, s, indices), x, experts, scores)
  assert_close(loss_and_grads(fn, x, experts, scores), want)


def test_identity_is_the_paper_layer_bit_for_bit_in_either_gate_position():
  """With no activation, act(g h) and g act(h) are the same float32 products: outputs and gradients identical."""
  fn_inside, x, experts, indices, scores = sgatlin_op(ACTS["identity"], BACKENDS["xla"])
  rows = (indices + N * jnp.arange(C)[None, None, :, None]).reshape(B, T, C * K)
  fn_outside = lambda x, e, s: gated_gather(  # noqa: E731
    x,
    e[0].reshape(C * N, D),
    e[1].reshape(C * N, D),
    rows,
    s.reshape(B, T, C * K),
    options=BACKENDS["xla"],
    gate_inside_activation=False,
  )
  for a, b in zip(
    jax.tree.leaves(loss_and_grads(fn_inside, x, experts, scores)),
    jax.tree.leaves(loss_and_grads(fn_outside, x, experts, scores)),
  ):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
  "variant, implementation, kernel",
  [
    ("fff", "sparse", "xla"),
    ("fff_post", "sparse", "xla"),
    ("fff", "masked_dense", "xla"),
    ("fff", "sparse", "triton"),
  ],
)
def test_fff_equals_a_per_token_tree_walk(variant, implementation, kernel):
  """Values of the layer against a float64 NumPy walk, token by token; one token's root logit is exactly 0
  (it must go left) and exact erf GELU (FFF paper, UltraFastBERT) is the default form. With the pallas kernels
  (Triton's, interpreted) the deeper levels are row_dots launches (tree_walk.with_row_dots)."""
  depth, n_trees, d_model = 4, 3, 8
  cfg = layer_model_config(
    "fff",
    d_model=d_model,
    depth=depth,
    n_trees=n_trees,
    variant=variant,
    implementation=implementation,
    kernel=dict(implementation=kernel),
  )
  layer = Fff(cfg)
  x = jax.random.normal(jax.random.key(5), (2, 6, d_model))
  params = init_params(layer, x)
  params["b_out"] = jax.random.normal(jax.random.key(6), (d_model,)) * 0.1
  params["b_in"] = params["b_in"].at[0, 0].set(0.0)
  x = x.at[0, 0].set(0.0)  # token 0: every logit is its bias, and tree 0's root logit is exactly 0
  y = layer.apply({"params": params}, x)
  want, path = official.fff_walk(
    np.asarray(x).reshape(-1, d_model), params["w_in"], params["b_in"], params["w_out"], params["b_out"], depth, variant
  )
  assert path[0, 0, 1] == 1  # the tie went left
  np.testing.assert_allclose(np.asarray(y).reshape(-1, d_model), want, rtol=1e-5, atol=1e-6)


def test_gelu_form_defaults_to_each_layers_code_also_for_configs_saved_before_the_field():
  """gelu_approximate None (the default, and a saved config without it): tanh for peer and sgatlin, erf for fff."""
  from sparsetx import config as config_lib
  from sparsetx.models.ffn.common import gelu_approximate
  from sparsetx.train.checkpoints import checkpointing

  saved = config_lib.default_config().to_dict()
  del saved["model"]["ffn"]["gelu_approximate"]
  ffn = checkpointing.config_from_saved(saved).model.ffn
  assert ffn.gelu_approximate is None
  for ffn_type, want in (("peer", True), ("sgatlin", True), ("fff", False)):
    ffn.type = ffn_type
    assert gelu_approximate(ffn) is want
  ffn.gelu_approximate = False
  assert gelu_approximate(ffn) is False
  saved["model"]["ffn"].update(type="peer", gelu_approximate="tanh")  # a hand-edited JSON config
  with pytest.raises(config_lib.ConfigError, match=r"config.model.ffn.gelu_approximate='tanh'"):
    config_lib.validate(checkpointing.config_from_saved(saved))

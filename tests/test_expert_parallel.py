"""Expert-parallel layers (8 simulated devices) equal, in values and gradients, the authors' formulas
(tests/official_refs.py: sgatlin with each ablation activation after the gate, PEER with tanh GELU) or, for
FFF and MoE, the single-device layers."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import official_refs as official
import pytest
from conftest import SPARSE_LAYERS_OF_8, init_params, layer_model_config

from sparsetx import config as config_lib
from sparsetx.kernels.options import KernelOptions
from sparsetx.models.ffn import moe
from sparsetx.models.ffn.registry import FFN_LAYERS
from sparsetx.parallel import expert_collectives, logical_rules, sparse_forms, topology
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.perf import hlo_text

D = 16
LAYERS = {
  **SPARSE_LAYERS_OF_8,
  "sgatlin_c4": dict(n_channels=4, d_ffw=36, top_k=2, d_key=8),  # fewer channels than devices
}
MESHES = {
  "expert8": dict(expert=8),
  "expert4_fsdp2": dict(expert=4, fsdp=2),
  "data2_expert4": dict(data=2, expert=4),
}


def make_mesh(devices=None, **axes):
  config = config_lib.default_config().mesh
  config.ici.update(data=1, fsdp=1, tensor=1, expert=1)
  config.ici.update(axes)
  return mesh_lib.make_mesh(config, devices)


def lowered_for_h100(fn, args, mesh):
  """fn's program for 8 H100s (a topology's devices, parallel/topology.py) laid out as `args` are on `mesh`:
  lowered, not run (XLA:CPU widens bf16 collectives to float32 and has no ragged all-to-all)."""
  gpu_mesh = make_mesh(topology.devices("h100:1x1x8"), **dict(mesh.shape))
  abstract = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(
      a.shape,
      a.dtype,
      sharding=jax.sharding.NamedSharding(gpu_mesh, getattr(a.sharding, "spec", jax.sharding.PartitionSpec())),
    ),
    args,
  )
  with logical_rules.activate(gpu_mesh):
    return jax.jit(fn).trace(*abstract).lower()


# sgatlin's ablation activation per (layer, mesh): each of identity, relu, gelu, swish on a channel split
# (expert-parallel form) and on a d_model split (split_gated_gather), raw scores of both signs as gates.
ACTIVATION = {
  ("sgatlin", "expert8"): "gelu",
  ("sgatlin", "data2_expert4"): "relu",
  ("sgatlin", "expert4_fsdp2"): "swish",
  ("sgatlin_c4", "expert8"): "relu",
  ("sgatlin_c4", "expert4_fsdp2"): "gelu",
  ("sgatlin", "data2_tensor4"): "swish",
  ("sgatlin", "data2_expert2_tensor2"): "identity",
}


def official_apply(name, activation):
  """The authors' formula for this layer (params -> y), or None where the single-device layer is the reference."""
  k = LAYERS[name].get("top_k")
  if name.startswith("sgatlin"):
    return lambda p, x: official.sgatlin(p, x, k, official.ACTIVATIONS[activation])  # noqa: E731
  if name == "peer":
    return lambda p, x: official.peer(p, x, k)  # noqa: E731
  return None


@functools.cache
def case(name, activation="identity"):
  """(layer, params, x, probe, (reference values, reference grads)) on one device."""
  ffn_type = name.split("_")[0]
  extra = dict(activation=activation) if ffn_type == "sgatlin" else {}
  layer = FFN_LAYERS[ffn_type](layer_model_config(ffn_type, d_model=D, **LAYERS[name], **extra))
  x = jax.random.normal(jax.random.key(1), (8, 4, D))
  params = init_params(layer, x)
  if ffn_type == "moe":
    params["router"]["kernel"] = params["router"]["kernel"] * 50  # spread tokens over every expert
  probe = jax.random.normal(jax.random.key(2), (8, 4, D))
  reference = official_apply(name, activation) or (lambda p, x: layer.apply({"params": p}, x))  # noqa: E731
  want = jax.jit(functools.partial(forward_and_grads, reference, probe))(params, x)
  return layer, params, x, probe, jax.device_get(want)


def layer_apply(layer):
  return lambda p, x: layer.apply({"params": p}, x)  # noqa: E731


def assert_matches(name, y, grads, want_y, want_grads):
  """Float32 sums in another order: 1e-5 of each gradient's largest entry against the single-device layer,
  1e-4 against the official formulas (another gather, the router's sums by brute force)."""
  rtol, atol = (1e-4, 1e-5) if official_apply(name, "identity") else (1e-5, 2e-6)
  np.testing.assert_allclose(y, want_y, rtol=rtol, atol=max(atol, 1e-5))
  for (path, g), w in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads)):
    scale = np.abs(w).max() + 1e-6
    np.testing.assert_allclose(g / scale, w / scale, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def forward_and_grads(apply, probe, params, x):
  y = apply(params, x)
  grads = jax.grad(lambda p, x: jnp.sum(jnp.sin(apply(p, x)) * probe), argnums=(0, 1))(params, x)
  return y, grads


# Tables split by d_model over the expert axis too (FSDP over fsdp x expert for every `embed` axis, channels
# whole): PEER's shared table, and sgatlin's when the expert axis is larger than its channel count.
D_SPLIT_RULES = logical_rules.D_MODEL_SPLIT_RULES + config_lib.DEFAULT_RULES
RULES = {"peer": D_SPLIT_RULES, ("sgatlin_c4", "expert8"): D_SPLIT_RULES}
# sgatlin on expert4_fsdp2 holds rows[:, c-block, :, d-slice] (channels over expert, d_model over fsdp);
# sgatlin_c4 there is C=4 on 8 devices as channels x d-halves, and on expert8 (d_model split rules) d-eighths.
CASES = [(ffn, mesh) for ffn in LAYERS for mesh in MESHES if ffn != "sgatlin_c4" or mesh != "data2_expert4"]


def run_sharded(layer, params, x, probe, mesh, rules):
  """(y, grads, the compiled step, the parameters' shardings) of the layer with its parameters and x on the mesh."""
  boxed = jax.eval_shape(layer.init, jax.random.key(0), x)["params"]
  param_shardings = mesh_lib.logical_sharding(nn.get_partition_spec(boxed), mesh, rules)
  batch = mesh_lib.batch_sharding(mesh, rules)
  x_sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*batch.spec, None)))
  with logical_rules.activate(mesh, rules):
    step = jax.jit(functools.partial(forward_and_grads, layer_apply(layer), probe))
    compiled = step.lower(jax.device_put(params, param_shardings), x_sharded).compile()
    y, grads = compiled(jax.device_put(params, param_shardings), x_sharded)
  return y, grads, compiled, param_shardings


@pytest.mark.parametrize("ffn_type, mesh_name", CASES)
def test_sharded_layer_equals_the_official_formula(ffn_type, mesh_name):
  layer, params, x, probe, (want_y, want_grads) = case(ffn_type, ACTIVATION.get((ffn_type, mesh_name), "identity"))
  mesh = make_mesh(**MESHES[mesh_name])
  rules = RULES.get((ffn_type, mesh_name), RULES.get(ffn_type, config_lib.DEFAULT_RULES))
  y, grads, compiled, param_shardings = run_sharded(layer, params, x, probe, mesh, rules)
  hlo = compiled.as_text()
  if ffn_type in ("sgatlin", "sgatlin_c4", "peer"):  # the table is stored split over every expert and fsdp device
    table = params["experts"]
    shard = param_shardings["experts"].shard_shape(table.shape)
    assert np.prod(shard) * mesh.shape["expert"] * mesh.shape["fsdp"] == table.size
  if ffn_type == "peer" or (ffn_type, mesh_name) == ("sgatlin_c4", "expert8"):
    # the d-split form ran: x and y moved by d-slice, partial dots summed
    assert "all-to-all" in hlo and "all-reduce" in hlo
  elif ffn_type == "moe":  # each token went to its experts' devices and back: all-to-alls, no reduce-scatter
    assert "all-to-all" in hlo and "reduce-scatter" not in hlo
  else:  # the expert-parallel form ran: tokens moved, outputs reduce-scattered
    assert "reduce-scatter" in hlo and ("all-gather" in hlo or "all-to-all" in hlo)
  assert_matches(ffn_type, y, grads, want_y, want_grads)


# A d-split over a mesh axis that does not split the batch: the table's d_model over `tensor` while the batch is
# split over `data` (and `expert`) only, replicated over tensor, so x's d-slices are local slices, not an all-to-all,
# and the outputs' slices come back by all-gather. On data2_expert2_tensor2 sgatlin's channels go to `expert` too
# (units moved by all-to-all, d_model sliced locally); elsewhere the channels stay whole.
TENSOR_SPLIT_RULES = (("embed", "tensor"), ("channel", None)) + config_lib.DEFAULT_RULES
TENSOR_SPLIT_CHANNELS_OVER_EXPERT_RULES = (("embed", "tensor"),) + config_lib.DEFAULT_RULES
TENSOR_SPLIT_CASES = {
  ("peer", "data2_tensor4"): (dict(data=2, tensor=4), TENSOR_SPLIT_RULES),
  ("sgatlin", "data2_tensor4"): (dict(data=2, tensor=4), TENSOR_SPLIT_RULES),
  ("sgatlin", "data2_expert2_tensor2"): (dict(data=2, expert=2, tensor=2), TENSOR_SPLIT_CHANNELS_OVER_EXPERT_RULES),
}


@pytest.mark.parametrize("ffn_type, mesh_name", list(TENSOR_SPLIT_CASES))
def test_d_split_over_a_non_batch_axis_equals_the_official_formula(ffn_type, mesh_name, monkeypatch):
  layer, params, x, probe, (want_y, want_grads) = case(ffn_type, ACTIVATION.get((ffn_type, mesh_name), "identity"))
  axes, rules = TENSOR_SPLIT_CASES[ffn_type, mesh_name]
  mesh = make_mesh(**axes)
  boxed = jax.eval_shape(layer.init, jax.random.key(0), x)["params"]
  param_shardings = mesh_lib.logical_sharding(nn.get_partition_spec(boxed), mesh, rules)
  batch = mesh_lib.batch_sharding(mesh, rules)
  assert "tensor" not in jax.tree.leaves(tuple(batch.spec))
  x_sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*batch.spec, None)))
  groups = []  # the groups the layer ran `split_gated_gather` with
  split_gated_gather = sparse_forms.split_gated_gather
  spy = lambda group, *args, **kwargs: groups.append(group) or split_gated_gather(group, *args, **kwargs)  # noqa: E731
  monkeypatch.setattr(sparse_forms, "split_gated_gather", spy)
  with logical_rules.activate(mesh, rules):
    step = jax.jit(functools.partial(forward_and_grads, layer_apply(layer), probe))
    y, grads = step(jax.device_put(params, param_shardings), x_sharded)
  units = ("expert",) if "expert" in axes else ()
  assert groups and all(g.split == ("tensor",) and g.units == units for g in groups)
  table = params["experts"]
  shard = param_shardings["experts"].shard_shape(table.shape)
  assert np.prod(shard) * axes["tensor"] * axes.get("expert", 1) == table.size  # stored split: d_model (x channels)
  assert_matches(ffn_type, y, grads, want_y, want_grads)


# The accelerator path on a mesh: the row kernels (Triton's, in interpret mode on CPU) inside the expert-parallel
# forms: channels split (sgatlin), d_model split (sgatlin_c4 on expert8: the partial dots are row_dots on each
# device's d-slice), trees split (FFF: the deeper walk levels are row_dots launches).
KERNEL_CASES = [("sgatlin", "expert8"), ("sgatlin_c4", "expert8"), ("fff", "data2_expert4")]


@pytest.mark.parametrize("ffn_type, mesh_name", KERNEL_CASES)
def test_row_kernels_on_a_mesh_equal_the_official_formula(ffn_type, mesh_name):
  activation = ACTIVATION.get((ffn_type, mesh_name), "identity")
  _, params, x, probe, (want_y, want_grads) = case(ffn_type, activation)
  name = ffn_type.split("_")[0]
  extra = dict(activation=activation) if name == "sgatlin" else {}
  kernel = dict(implementation="triton")
  layer = FFN_LAYERS[name](layer_model_config(name, d_model=D, **LAYERS[ffn_type], **extra, kernel=kernel))
  mesh = make_mesh(**MESHES[mesh_name])
  rules = RULES.get((ffn_type, mesh_name), RULES.get(ffn_type, config_lib.DEFAULT_RULES))
  y, grads, _, _ = run_sharded(layer, params, x, probe, mesh, rules)
  assert_matches(ffn_type, y, grads, want_y, want_grads)


@pytest.mark.parametrize("mesh_name", ["expert8", "data2_expert4"])
def test_moe_sends_each_token_only_to_its_experts(mesh_name):
  """MoE's collectives, forward and backward, on G = 8 or 4 devices of the expert axis (n = 4 tokens each, k = 2,
  D = 16, X = 8 experts). Payload: the pairs' x rows out, their outputs back, and the transposes of both, by
  ragged all-to-all on the accelerators (4 `ragged_all_to_all` calls, no all-gather or reduce-scatter of tokens);
  a ragged all-to-all sends only its real rows, each pair once, so a device sends at most k·D·b bytes per own token
  each way, k·D·b·(G-1)/G when routing is balanced (the pairs for its own experts stay). Metadata: one all-gather of
  the per-expert counts, G·X int32, per layer call (G·X·4/n bytes per token). The CPU's padded stand-in moves
  G blocks of n·k rows (G·k·D·b per token) by plain all-to-alls; no collective gathers tokens there either."""
  layer, params, x, probe, _ = case("moe")
  mesh = make_mesh(**MESHES[mesh_name])
  G, n, k, X = mesh.shape["expert"], 4, LAYERS["moe"]["experts_per_token"], LAYERS["moe"]["n_experts"]
  boxed = jax.eval_shape(layer.init, jax.random.key(0), x)["params"]
  params = jax.device_put(
    params, mesh_lib.logical_sharding(nn.get_partition_spec(boxed), mesh, config_lib.DEFAULT_RULES)
  )
  batch = mesh_lib.batch_sharding(mesh, config_lib.DEFAULT_RULES)
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*batch.spec, None)))
  loss = lambda p, x: jnp.sum(jnp.sin(layer.apply({"params": p}, x)) * probe)  # noqa: E731
  with logical_rules.activate(mesh):
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile()
  lowered = lowered_for_h100(jax.value_and_grad(loss, argnums=(0, 1)), (params, x), mesh)
  moe = [c for c in hlo_text.collectives(compiled.as_text()) if "Moe" in c.source and "/router/" not in c.source]
  table_grads = [c for c in moe if c.op == "all-reduce"]  # the expert tables' gradients summed over `data`
  assert all(c.group == mesh.shape["data"] for c in table_grads)
  moe = [c for c in moe if c.op != "all-reduce"]
  payload = [c for c in moe if c.shape.lstrip("(").startswith("f32")]
  metadata = [c for c in moe if c.shape.lstrip("(").startswith("s32")]
  assert {c.op for c in moe} == {"all-gather", "all-to-all"} and len(payload) + len(metadata) == len(moe)
  assert [(c.op, c.nbytes, c.group) for c in payload] == [("all-to-all", G * n * k * D * 4, G)] * 4
  assert [c.op for c in metadata].count("all-gather") == 1
  assert all(c.nbytes <= G * X * 4 for c in metadata)

  text = lowered.as_text()
  ragged = re.findall(r"custom_call @ragged_all_to_all\(.*\) -> tensor<(\d+)x(\d+)xf32>", text)
  assert sorted((int(r), int(d)) for r, d in ragged) == [(n * k, D)] * 2 + [(G * n * k, D)] * 2
  assert "reduce_scatter" not in text
  gathers = re.findall(r"stablehlo.all_gather.*-> tensor<([^>]*)>", text)
  assert gathers == [f"{G}x{X}xi32"]  # the counts; no token is gathered

  # The ragged sends' real rows for this routing: the pairs whose expert lives on another device.
  ids = np.asarray(
    jax.jit(lambda p, x: layer.apply({"params": p}, x, mutable="intermediates")[1])(params, x)["intermediates"][
      "expert_ids"
    ][0]
  )
  owner = ids.reshape(-1, k) // (X // G)  # [tokens in device order, k]
  device = np.arange(owner.shape[0])[:, None] // n % G  # the token's position on the expert axis
  off_device_per_token = (owner != device).sum() / owner.shape[0]
  assert 0 < off_device_per_token <= k
  print(
    f"{mesh_name}: {off_device_per_token:.2f} of k={k} pairs per token leave the device; (G-1)/G·k = {(G - 1) / G * k:.2f}"
  )


def test_moe_rows_travel_in_bf16_and_the_owner_sums_them_in_float32():
  """A bf16 run on expert8: the four ragged all-to-alls (x rows, outputs, dy rows, dx rows) carry bf16. Each
  pair's output y_j is rounded to bf16 for the trip back (relative error <= u = 2^-8) and the owner sums
  w_j * y_j in float32, so against the single-device layer (sum in float32, one rounding) the difference is at
  most u·sum_j w_j |y_j| before the final roundings and 3u·sum_j w_j |y_j| after both (plus float32 noise)."""
  layer, params, x, _, _ = case("moe")
  x = x.astype(jnp.bfloat16)
  N, k = x.shape[0] * x.shape[1], LAYERS["moe"]["experts_per_token"]
  single, state = jax.jit(lambda p, x: layer.apply({"params": p}, x, mutable="intermediates"))(params, x)
  ids, weights = (state["intermediates"][name][0].reshape(N, k) for name in ("expert_ids", "expert_weights"))
  x_ND = x.reshape(N, D)
  terms = 0.0  # sum_j w_j |y_j|, each slot's expert output in float32 from the same bf16 inputs
  for j in range(k):
    order = jnp.argsort(ids[:, j])
    sizes = jnp.bincount(ids[:, j], length=LAYERS["moe"]["n_experts"]).astype(jnp.int32)
    y_j = moe.sorted_experts(KernelOptions(), x_ND[order], sizes, params["wi_gate"], params["wi_up"], params["wo"])[
      jnp.argsort(order)
    ]
    terms = terms + weights[:, j : j + 1] * jnp.abs(y_j)
  mesh = make_mesh(**MESHES["expert8"])
  batch = mesh_lib.batch_sharding(mesh, config_lib.DEFAULT_RULES)
  x_sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*batch.spec, None)))
  loss = lambda p, x: jnp.sum(layer.apply({"params": p}, x).astype(jnp.float32))  # noqa: E731
  with logical_rules.activate(mesh):
    y = jax.jit(layer_apply(layer))(params, x_sharded)
  text = lowered_for_h100(jax.grad(loss, argnums=(0, 1)), (params, x_sharded), mesh)
  payload = re.findall(r"custom_call @ragged_all_to_all\(.*\) -> tensor<\d+x\d+x(\w+)>", text.as_text())
  assert payload == ["bf16"] * 4
  difference = np.abs(np.asarray(y, np.float32) - np.asarray(single, np.float32)).reshape(N, D)
  bound = (3 * 2.0**-8 + 1e-5) * np.asarray(terms) + 1e-6
  assert np.all(difference <= bound), float((difference / bound).max())


# Experts 0 and 1 favoured by the router's bias: on data2_expert4 (2 experts per device) every pair of the group goes
# to the first device of the expert axis, filling its receive buffer (G·n·k rows) exactly; with `batch` not split
# over `expert`, every device of the expert axis holds the same tokens and the layer keeps the gathered form.
SKEW_CASES = {
  "all_pairs_to_one_device": (config_lib.DEFAULT_RULES, 30.0),
  "expert_axis_not_splitting_the_batch": ((("batch", ("data", "fsdp")),) + config_lib.DEFAULT_RULES, 0.0),
}


@pytest.mark.parametrize("name", list(SKEW_CASES))
def test_moe_on_data2_expert4_equals_the_single_device_layer(name):
  rules, bias = SKEW_CASES[name]
  layer, params, x, probe, _ = case("moe")
  params = jax.tree.map(lambda a: a, params)
  params["router"]["bias"] = params["router"]["bias"].at[:2].add(bias)
  want_y, want_grads = jax.device_get(
    jax.jit(functools.partial(forward_and_grads, layer_apply(layer), probe))(params, x)
  )
  y, grads, compiled, _ = run_sharded(layer, params, x, probe, make_mesh(**MESHES["data2_expert4"]), rules)
  hlo = compiled.as_text()
  if bias:
    ids = np.asarray(layer.apply({"params": params}, x, mutable="intermediates")[1]["intermediates"]["expert_ids"][0])
    assert set(np.unique(ids)) == {0, 1}  # every pair on the expert axis' first device
    assert "all-to-all" in hlo and "reduce-scatter" not in hlo
  else:
    assert "all-to-all" not in hlo  # tokens already on every device of the expert axis: outputs summed over it
  assert_matches("moe", y, grads, want_y, want_grads)


def test_sgatlin_dy_travels_in_bf16_with_the_same_values(monkeypatch):
  """A bf16 run of sgatlin's channel split on expert8: the output's partial sums are reduce-scattered in float32
  and cast to bf16, so the backward's dy holds bf16 values and its all-gather moves them in bf16, where the
  gradients were all-gathered in float32 before: the same values and gradients, bit for bit, in half the bytes.
  The forward's all-gathers of x and this one are the layer's only all-gathers of [group tokens, D]."""
  layer, params, x, probe, _ = case("sgatlin", ACTIVATION["sgatlin", "expert8"])
  mesh = make_mesh(**MESHES["expert8"])
  boxed = jax.eval_shape(layer.init, jax.random.key(0), x)["params"]
  params = jax.device_put(
    params, mesh_lib.logical_sharding(nn.get_partition_spec(boxed), mesh, config_lib.DEFAULT_RULES)
  )
  batch = mesh_lib.batch_sharding(mesh, config_lib.DEFAULT_RULES)
  spec = jax.sharding.PartitionSpec(*batch.spec, None)
  x = jax.device_put(x.astype(jnp.bfloat16), jax.sharding.NamedSharding(mesh, spec))

  def run():
    with logical_rules.activate(mesh):
      step = jax.jit(functools.partial(forward_and_grads, layer_apply(layer), probe))
      lowered = step.lower(params, x)
      return jax.device_get(lowered.compile()(params, x)), re.findall(
        rf"stablehlo.all_gather.*-> tensor<{x.shape[0] * x.shape[1]}x{D}x(\w+)>", lowered.as_text()
      )

  (y, grads), gathers = run()
  scatter_back = expert_collectives.scatter_back
  monkeypatch.setattr(expert_collectives, "scatter_back", lambda y_g, group, out_dtype=None: scatter_back(y_g, group))
  (y_f32_wire, grads_f32_wire), gathers_f32_wire = run()
  # x's (the forward runs twice here: y, and the gradient's linearization) and dy's
  assert sorted(gathers) == ["bf16"] * 3 and sorted(gathers_f32_wire) == ["bf16", "bf16", "f32"]
  assert y.dtype == jnp.bfloat16 and np.array_equal(y, y_f32_wire)
  for (path, g), w in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(grads_f32_wire)):
    assert np.array_equal(g, w), jax.tree_util.keystr(path)

"""Layers as a scan (models/transformer.py: layer_groups, scan_blocks): the scanned forward equals the per-layer
loop in the train step (loss, gradients, sparse statistics, usage counts) on 8 devices with micro-batches; a
checkpoint written by either form resumes the other bitwise; decoding (the loop) continues the scanned forward."""

import dataclasses
import importlib.util
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import synthetic_batch
from test_train import assert_same_step, micro_config, one_step

from sparsetx import config as config_lib
from sparsetx import scopes
from sparsetx.models import transformer
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.perf import hlo_text
from sparsetx.plan import memory, targets
from sparsetx.train import state as state_lib
from sparsetx.train.checkpoints import checkpointing


def layered(ffn_type: str, n_layers: int = 3, ffn_layers: str = "", **train):
  config = micro_config(ffn_type, warmup_steps=0, **train)
  config.model.update(n_layers=n_layers, ffn_layers=ffn_layers, scan_layers=True)
  return config


def scan_lengths(config) -> list:
  """The lengths of the scans over layers in the traced forward (a scan's length is its layer count)."""
  model = transformer.Transformer(ml_collections.FrozenConfigDict(config.model))
  tokens = jnp.zeros((2, 8), jnp.int32)
  params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens)))
  jaxpr = jax.make_jaxpr(lambda p: model.apply(p, tokens))(params)
  return [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"]


def test_groups_are_the_runs_of_like_layers():
  config = layered("sgatlin", n_layers=6, ffn_layers="1,2,3")
  assert transformer.layer_groups(config.model) == ((0,), (1, 2, 3), (4, 5))
  assert transformer.layer_groups(layered("fff", n_layers=4).model) == ((0, 1, 2, 3),)
  assert scan_lengths(config) == [3, 2]  # the lone dense layer 0 runs unscanned
  config.model.scan_layers = False
  assert [n for n in scan_lengths(config) if n > 1] == []  # the sparse layers' own token-chunk scans have length 1


def test_scanned_forward_and_gradients_equal_the_loop():
  """One device, every tap: the scanned model's logits, taps (each under its `layers_i`) and parameter gradients
  equal the loop's within float32 rounding (another fusion and summation order; 1e-4 of each leaf's largest)."""
  config = layered("sgatlin", n_layers=4, ffn_layers="1,2,3")
  tokens = jnp.asarray(synthetic_batch(config)["inputs"][:2])

  def run(scan: bool):
    config.model.scan_layers = scan
    model = transformer.Transformer(ml_collections.FrozenConfigDict(config.model))
    params = nn.unbox(model.init(jax.random.key(0), tokens))["params"]

    def loss(params):
      logits, state = model.apply({"params": params}, tokens, mutable=["intermediates"])
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), (logits, state["intermediates"])

    return jax.jit(jax.grad(loss, has_aux=True))(params)

  got, want = run(True), run(False)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, a), b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=jax.tree_util.keystr(path))


@pytest.mark.long  # two train steps compiled on 8 devices: about a minute each
@pytest.mark.parametrize("ffn_type", ["sgatlin", "fff", "moe", "peer", "mixed"])
def test_scanned_step_equals_the_loop_on_a_mesh_with_micro_batches(ffn_type):
  """Scan and loop run the same float32 arithmetic in another fusion and summation order: gradients agree within
  float32 rounding of their sums (assert_same_step: 1e-4 of each leaf's largest element), the routed picks exactly."""
  config = layered("sgatlin", n_layers=4, ffn_layers="1,2") if ffn_type == "mixed" else layered(ffn_type)
  config.data.global_batch_size = 16
  config.train.microbatches = 2
  config.mesh.ici.update(data=2, fsdp=2, expert=2)
  mesh = mesh_lib.make_mesh(config.mesh)
  scanned = one_step(config, mesh)
  config.model.scan_layers = False
  looped = one_step(config, mesh)
  assert_same_step(config, scanned, looped)
  metrics, want = scanned[1], looped[1]
  assert set(metrics) == set(want)
  for name in want:  # the sparse statistics of every layer, each under its own layers_i name
    np.testing.assert_allclose(metrics[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
  assert any(name.startswith("usage_counts/") for name in want) or ffn_type == "mlp"


def shapes(tree) -> list:
  """(path, shape, dtype) of every leaf: the tree a checkpoint holds (the state's apply_fn, a static field that
  carries the config, is not saved)."""
  return [(jax.tree_util.keystr(path), leaf.shape, leaf.dtype) for path, leaf in jax.tree.leaves_with_path(tree)]


def test_a_checkpoint_written_by_either_form_resumes_the_other_bitwise(tmp_path):
  """Parameters stay per layer (`layers_i`) in the state, so the saved tree is the same scanned or not."""
  config = layered("sgatlin")
  loop_config = config.copy_and_resolve_references()
  loop_config.model.scan_layers = False
  for write, read, directory in ((loop_config, config, "loop"), (config, loop_config, "scan")):
    built = state_lib.setup(write, mesh=state_lib.single_device_mesh(write))
    state = state_lib.create_state(write, built.shardings, built.model, built.tx)
    checkpointer = checkpointing.Checkpointer(str(tmp_path / directory), write.checkpoint)
    checkpointer.save(1, state, write, data_state=None)
    checkpointer.wait()
    checkpointer.check_compatible(1, read)  # scan_layers is compute-only: either may resume the other
    reader = state_lib.setup(read, mesh=state_lib.single_device_mesh(read))
    assert shapes(reader.abstract_state) == shapes(built.abstract_state)  # the same tree to read into
    restored = checkpointer.restore_state(1, reader.abstract_state)
    checkpointer.close()
    for (path, got), want in zip(jax.tree.leaves_with_path(restored), jax.tree.leaves(state)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))


def test_decoding_with_the_cache_continues_the_scanned_forward():
  """Decoding runs the per-layer loop on the same parameters: its logits, token by token, equal the scanned full
  forward's within float32 rounding (attention over a cache of another length sums in another order)."""
  config = layered("sgatlin")
  model = transformer.Transformer(ml_collections.FrozenConfigDict(config.model))
  tokens = jnp.asarray(synthetic_batch(config)["inputs"][:2, :12])
  params = nn.unbox(model.init(jax.random.key(0), tokens))["params"]
  assert transformer.scans_layers(model.cfg)
  full = model.apply({"params": params}, tokens)
  cache = transformer.init_cache(model, 2)
  steps = []
  for t in range(tokens.shape[1]):
    logits, variables = model.apply(
      {"params": params, "cache": cache}, tokens[:, t : t + 1], decode=True, mutable=["cache"]
    )
    cache = variables["cache"]
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.long  # two compiles for TPU v5p, about a minute
def test_a_deeper_model_compiles_to_one_loop_over_its_layers_with_the_same_kernels():
  """16 layers against 4, compiled by libtpu (the compile suite's shapes and HLO reader): one while loop over the
  layers in the forward and one in the backward, and the same kernel launches in the program (the body's)."""
  from test_compile import compile_config, compiled, kernels

  found = {}
  for n_layers in (4, 16):
    config = compile_config("sgatlin")
    config.model.update(n_layers=n_layers, scan_layers=True)
    text = compiled(config, "v5p").text
    assert [loop.trips for loop in hlo_text.compiled_loops(text)].count(n_layers) == 2, hlo_text.compiled_loops(text)
    found[n_layers] = kernels(text)
  assert found[4] and found[16] == found[4], found


def router_top_k_ops(jaxpr, under: bool = False) -> int:
  """Top-k operations (lax.top_k, sort, the CPU passes' reduce_max) under the router scope (a sub-jaxpr's names
  are relative to its equation's), sub-jaxprs included: a forward's own plus any the backward recomputes."""
  found = 0
  for eqn in jaxpr.eqns:
    here = under or scopes.ROUTER in str(eqn.source_info.name_stack).split("/")
    found += here and eqn.primitive.name in ("top_k", "sort", "reduce_max")
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found += router_top_k_ops(inner, here)
  return found


@pytest.mark.parametrize("scan", [True, pytest.param(False, marks=pytest.mark.long)])  # 4 policies: ~30 s each
def test_each_remat_policy_has_nones_gradients_and_save_routing_no_second_top_k(scan):
  """Remat recomputes the same float32 operations: gradients equal within rounding of a fused recompute (1e-5 of
  each leaf's largest). save_routing keeps the routed indices and gates, so its backward runs no router top-k
  (full recomputes them)."""
  config = layered("sgatlin", n_layers=2)
  config.model.scan_layers = scan
  tokens = jnp.asarray(synthetic_batch(config)["inputs"][:2])
  grads, top_k = {}, {}
  for policy in ("none", "full", "save_routing", "save_dots"):
    config.model.remat = policy
    model = transformer.Transformer(ml_collections.FrozenConfigDict(config_lib.validate(config).model))
    params = nn.unbox(model.init(jax.random.key(0), tokens))["params"]
    grad = jax.grad(lambda p: jnp.mean(jax.nn.log_softmax(model.apply({"params": p}, tokens))[..., 0]))  # noqa: B023
    top_k[policy] = router_top_k_ops(jax.make_jaxpr(grad)(params).jaxpr)
    grads[policy] = jax.jit(grad)(params)
  for policy in ("full", "save_routing", "save_dots"):
    for (path, a), b in zip(jax.tree.leaves_with_path(grads[policy]), jax.tree.leaves(grads["none"])):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(), err_msg=f"{policy} {path}")
  assert top_k["save_routing"] == top_k["none"] < top_k["full"], top_k


def test_the_plan_puts_save_routing_between_full_and_none_and_the_ladder_picks_it_when_only_it_fits():
  """save_routing keeps the block's input and attention output (2 nD, bf16) and per channel and slot two int32
  picks and a float32 gate; the ladder takes the cheapest recompute whose planned step fits half the HBM."""
  spec = importlib.util.spec_from_file_location(
    "ladder_config", pathlib.Path(__file__).parents[1] / "configs/ladder.py"
  )
  ladder_config = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(ladder_config)
  config = ladder_config.get_config("sgatlin,4,h100x8")
  model, n = config.model, 8192
  full, routing, none = (memory.layer_residual_bytes(config, n, p) for p in ("full", "save_routing", "none"))
  assert routing == 2 * n * model.d_model * 2 + n * model.ffn.n_channels * model.ffn.top_k * 12
  assert full < routing < none
  target = targets.parse("h100x8")
  expert = targets.expert_size(target, ladder_config.units(model))
  planned = {}
  for policy in ("none", "save_routing", "full"):
    config.model.remat = policy
    planned[policy] = memory.planned_device_bytes(config, target.devices, expert)
  assert planned["full"] < planned["save_routing"] < planned["none"]
  for hbm, want in ((2 * planned["none"], "none"), (planned["none"] + planned["save_routing"], "save_routing")):
    chip = dataclasses.replace(target.chip, hbm_bytes=hbm)
    assert ladder_config.remat_for(config, dataclasses.replace(target, chip=chip)) == want
  chip = dataclasses.replace(target.chip, hbm_bytes=planned["save_routing"])
  assert ladder_config.remat_for(config, dataclasses.replace(target, chip=chip)) == "full"

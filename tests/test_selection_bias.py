"""Loss-free balancing (sparsetx/models/ffn/selection_bias.py): the update against the rule written out unit by unit,
the choice made on biased scores and the gates on unbiased ones, the step with the option off or with a zero bias
bitwise the plain step, the bias through a checkpoint, the same bias on a mesh, and an export that transformers runs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import init_params, layer_model_config, synthetic_batch
from test_train import micro_config, one_step

from sparsetx.models.ffn import selection_bias
from sparsetx.models.ffn.moe import Moe
from sparsetx.models.transformer import Transformer
from sparsetx.parallel import logical_rules
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib
from sparsetx.train.checkpoints import checkpointing

RATE = 0.001  # DeepSeek-V3's


def rule_by_hand(bias, loads, rate):
  """Wang et al. 2024: b_i += u * sign(mean load - load_i); torchtitan then subtracts the mean of the moves. One
  group of units, one unit at a time, in float64."""
  loads = [float(x) for x in loads]
  mean = sum(loads) / len(loads)
  moves = [rate * ((mean > x) - (mean < x)) for x in loads]
  centre = sum(moves) / len(moves)
  return [float(b) + m - centre for b, m in zip(bias, moves)]


def test_update_is_the_sign_rule_centred_per_group():
  rng = np.random.default_rng(0)
  loads = rng.integers(0, 50, (3, 8)).astype(np.float32)
  loads[1] = [4, 4, 4, 4, 1, 7, 2, 6]  # four units exactly at the mean: they do not move before the centring
  loads[2] = 9.0  # balanced: nothing moves
  bias = rng.normal(size=(3, 8)).astype(np.float32) * 0.01
  got = np.asarray(selection_bias.update(jnp.asarray(bias), jnp.asarray(loads), 0.003))
  want = np.array([rule_by_hand(b, x, 0.003) for b, x in zip(bias, loads)])
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-8)  # float32 sums of values ~0.01: ulp ~1e-9
  np.testing.assert_array_equal(got[2], bias[2])
  np.testing.assert_allclose(got.sum(-1) - bias.sum(-1), 0.0, atol=1e-8)  # centred: no common drift


def balanced_config(**ffn):
  config = micro_config("moe", warmup_steps=0)
  config.model.ffn.update(dict(bias_update_rate=RATE), **ffn)
  return config


def biased_params(params, seed=1):
  """params with every selection bias set to random values large enough to change some tokens' experts."""
  rng = np.random.default_rng(seed)
  rest, biases = selection_bias.split(params)
  biases = {path: jnp.asarray(rng.normal(size=b.shape) * 0.5, jnp.float32) for path, b in biases.items()}
  return selection_bias.merge(rest, biases)


def run_step(config, state=None, edit=None):
  """(state before, state after, metrics) of one train step on one device from the config's init."""
  built = state_lib.setup(config, mesh=state_lib.single_device_mesh(config))
  state = state_lib.create_state(config, built.shardings, built.model, built.tx)
  if edit is not None:
    state = state.replace(params=jax.device_put(edit(jax.device_get(state.params)), built.shardings.params))
  step = step_lib.make_train_step(config, built)
  with logical_rules.activate(built.mesh, config.mesh.rules):
    before = jax.device_get(state)
    after, metrics = step(state, jax.device_put(synthetic_batch(config), built.batch_sharding))
  return before, jax.device_get(after), jax.device_get(metrics)


def test_a_step_moves_the_bias_by_the_rule_from_its_own_counts():
  """The bias after a step is the rule applied to the counts that step added to the window (from zero), per layer;
  the optimizer (AdamW with weight decay) leaves it alone."""
  before, after, _ = run_step(balanced_config(), edit=biased_params)
  biases = selection_bias.split(before.params)[1]
  assert sorted(biases) == [("layers_0", "mlp", selection_bias.NAME), ("layers_1", "mlp", selection_bias.NAME)]
  moved = selection_bias.split(after.params)[1]
  for path, bias in biases.items():
    counts = after.usage[path[0]]
    assert counts.sum() > 0 and counts.max() > counts.min()  # a real, uneven load
    np.testing.assert_allclose(moved[path], rule_by_hand(bias, counts, RATE), rtol=0, atol=1e-6)


@pytest.mark.parametrize("scores", ["softmax", "sigmoid"])
def test_the_bias_picks_the_experts_and_the_gates_ignore_it(scores):
  """A bias of +100 on experts 5 and 2 sends every token there; the gates are the unbiased scores of those two
  (softmax over their logits, or their sigmoids over their sum); no gradient reaches the bias."""
  cfg = layer_model_config("moe", d_model=16, d_ffw=8, n_experts=6, experts_per_token=2, bias_update_rate=RATE)
  cfg = ml_collections.FrozenConfigDict(cfg.to_dict() | {"ffn": dict(cfg.ffn.to_dict(), router_scores=scores)})
  layer = Moe(cfg)
  x = jax.random.normal(jax.random.key(0), (2, 5, 16))
  params = init_params(layer, x)
  params["router"]["kernel"] = params["router"]["kernel"] * 30
  params[selection_bias.NAME] = jnp.zeros(6).at[5].set(100.0).at[2].set(100.0)

  def forward(p):
    y, state = layer.apply({"params": p}, x, mutable=["intermediates"])
    return jnp.sum(jnp.cos(y)), state["intermediates"]

  (_, taps), grads = jax.value_and_grad(forward, has_aux=True)(params)
  ids = np.asarray(taps["expert_ids"][0])
  assert set(np.unique(ids)) == {2, 5}
  logits = np.asarray(x, np.float64) @ np.asarray(params["router"]["kernel"]) + np.asarray(params["router"]["bias"])
  top = np.take_along_axis(logits, ids, axis=-1)
  if scores == "softmax":
    want = np.exp(top - top.max(-1, keepdims=True))
  else:
    want = 1 / (1 + np.exp(-top))
  want = want / want.sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(taps["expert_weights"][0]), want, rtol=1e-5)
  assert not np.asarray(grads[selection_bias.NAME]).any()
  assert np.asarray(grads["router"]["kernel"]).any()


def test_off_has_no_bias_and_a_zero_bias_steps_bitwise_as_off():
  """Rate 0 builds no bias (the step is the one before the option); with the option on and the bias still 0 the
  first step chooses the same experts, so every other parameter, the loss and the norms are bitwise those of off."""
  off = micro_config("moe", warmup_steps=0)
  _, off_after, off_metrics = run_step(off)
  assert not selection_bias.split(off_after.params)[1]
  _, on_after, on_metrics = run_step(balanced_config())
  rest, biases = selection_bias.split(on_after.params)
  assert biases and all(np.abs(b).max() > 0 for b in biases.values())  # moved
  for name in ("loss", "grad_norm", "param_norm"):
    if name == "param_norm":
      continue  # it counts the moved bias too
    assert on_metrics[name] == off_metrics[name], name
  assert jax.tree.structure(rest) == jax.tree.structure(off_after.params)
  for (path, a), b in zip(jax.tree.leaves_with_path(rest), jax.tree.leaves(off_after.params)):
    assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32)), jax.tree_util.keystr(path)


def test_the_bias_is_checkpointed_and_resumed(tmp_path):
  config = balanced_config()
  built = state_lib.setup(config, mesh=state_lib.single_device_mesh(config))
  state = state_lib.create_state(config, built.shardings, built.model, built.tx)
  params = biased_params(jax.device_get(state.params))
  state = state.replace(params=jax.device_put(params, built.shardings.params))
  checkpointer = checkpointing.Checkpointer(str(tmp_path), config.checkpoint)
  checkpointer.save(3, state, config, data_state=None)
  checkpointer.wait()
  restored = checkpointer.restore_state(3, built.abstract_state)
  checkpointer.close()
  for path, bias in selection_bias.split(params)[1].items():
    np.testing.assert_array_equal(np.asarray(selection_bias.split(restored.params)[1][path]), bias)


@pytest.mark.long
def test_the_bias_moves_alike_on_one_device_and_a_mesh():
  """data=2 x fsdp=2 x expert=2 with two micro-batches (the per-device loop, where the bias enters as a constant):
  the same counts, so the same biases, bit for bit."""
  config = balanced_config()
  config.data.global_batch_size = 16
  single = config.mesh.copy_and_resolve_references()
  single.ici.update(data=1)
  params_1, metrics_1, _ = one_step(config, mesh_lib.make_mesh(single, jax.devices()[:1]))
  config.mesh.ici.update(data=2, fsdp=2, expert=2)
  config.train.microbatches = 2
  params_8, metrics_8, _ = one_step(config, mesh_lib.make_mesh(config.mesh))
  for name in ("usage_counts/layers_0", "usage_counts/layers_1"):
    np.testing.assert_array_equal(metrics_8[name], metrics_1[name])
  biases_1, biases_8 = selection_bias.split(params_1)[1], selection_bias.split(params_8)[1]
  assert biases_1.keys() == biases_8.keys() and biases_1
  for path in biases_1:
    assert np.abs(biases_1[path]).max() > 0
    np.testing.assert_array_equal(biases_8[path], biases_1[path])


def test_export_applies_the_bias_and_imports_it_back(tmp_path):
  """transformers' logits match JAX's for a model whose bias changes its choices (sigmoid scores, a shared expert),
  and the import gives the bias back bit for bit, in float32."""
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import torch  # noqa: PLC0415  (after the skip)
  from export_checks import random_params  # noqa: PLC0415

  from sparsetx.hf import export  # noqa: PLC0415

  config = balanced_config(router_scores="sigmoid", n_shared_experts=1)
  params = biased_params(random_params(config.model))
  tokens = np.random.default_rng(1).integers(0, config.model.vocab_size, (2, config.model.max_len)).astype(np.int32)
  apply = jax.jit(Transformer(ml_collections.FrozenConfigDict(config.model)).apply)
  expected = np.asarray(apply({"params": params}, tokens))
  unbiased = selection_bias.merge(
    *((lambda r, b: (r, {p: 0 * v for p, v in b.items()}))(*selection_bias.split(params)))
  )
  assert np.abs(np.asarray(apply({"params": unbiased}, tokens)) - expected).max() > 1e-2  # the bias matters here

  export.write_hf(config, params, str(tmp_path / "hf"))
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)
  with torch.no_grad():
    logits = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)
  _, imported = export.load_hf(str(tmp_path / "hf"))
  for path, bias in selection_bias.split(params)[1].items():
    got = selection_bias.split(nn.unbox(imported))[1][path]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, bias)


def test_a_bf16_export_keeps_the_bias_in_float32_on_disk_in_torch_and_on_import(tmp_path):
  """Rounded to bf16 a bias of ~0.2 moves by ~8e-4, about one update of DeepSeek-V3's rate, and flips near-tied
  picks: the bf16 export writes it in float32, transformers keeps it float32 in a bf16 model, the import bitwise."""
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import safetensors.numpy  # noqa: PLC0415
  import torch  # noqa: PLC0415  (after the skip)
  from export_checks import random_params  # noqa: PLC0415

  from sparsetx.hf import export  # noqa: PLC0415

  config = balanced_config()
  params = biased_params(random_params(config.model))
  biases = selection_bias.split(params)[1]
  assert any(not np.array_equal(b.astype(jnp.bfloat16).astype(np.float32), b) for b in biases.values())
  export.write_hf(config, params, str(tmp_path / "hf"), dtype="bfloat16")
  stored = {}
  for shard in (tmp_path / "hf").glob("*.safetensors"):
    stored.update(safetensors.numpy.load_file(shard))
  names = [name for name in stored if name.endswith(selection_bias.NAME)]
  assert len(names) == len(biases) and all(stored[name].dtype == np.float32 for name in names)
  assert any(array.dtype != np.float32 for array in stored.values())  # the rest in bf16
  model = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path / "hf", trust_remote_code=True, dtype=torch.bfloat16
  )
  in_torch = {name: p for name, p in model.named_parameters() if name.endswith(selection_bias.NAME)}
  assert len(in_torch) == len(biases) and all(p.dtype == torch.float32 for p in in_torch.values())
  np.testing.assert_array_equal(
    sorted(np.concatenate([p.detach().numpy().ravel() for p in in_torch.values()])),
    sorted(np.concatenate([np.asarray(b).ravel() for b in biases.values()])),
  )
  _, imported = export.load_hf(str(tmp_path / "hf"))
  for path, bias in biases.items():
    np.testing.assert_array_equal(selection_bias.split(nn.unbox(imported))[1][path], bias)


@pytest.mark.long  # four compiles of 10 to 30 s: make test-long
@pytest.mark.parametrize("target", ["v5p", "h100"])
def test_the_bias_update_adds_no_collective_to_the_compiled_step(target):
  """The v5p and H100 programs of MoE on data=2 x expert=2 (the ragged all-to-all) with two micro-batches (the
  per-device loop) have the same collectives with balancing on as off, the reductions and gathers byte for byte:
  the update reads the counts the step already reduces, and the bias has no gradient to reduce. (The ragged
  all-to-alls are compared by op and group: the compiler may run one of them as a start/done pair instead, whose
  tuple the byte reader does not size.)"""
  from test_compile import compile_config, compiled  # noqa: PLC0415  (the compile helpers: libtpu, CUDA wheels)

  from sparsetx.perf import hlo_text  # noqa: PLC0415

  found = {}
  for rate in (0.0, RATE):
    config = compile_config("moe", data=2, expert=2)
    config.model.ffn.update(bias_update_rate=rate)
    config.train.microbatches = 2
    collectives = hlo_text.collectives(compiled(config, target).text)
    found[rate] = sorted((c.op, 0 if c.op == "ragged-all-to-all" else c.nbytes, c.group) for c in collectives)
  assert found[RATE] == found[0.0]
  assert any(op == "ragged-all-to-all" for op, _, _ in found[0.0])  # the expert-parallel program indeed


def subkey_loads_by_hand(counts, channels, n_keys):
  """[channel][half][sub-key] picks: neuron i * n_keys + j of a channel is sub-key i of half 1 and j of half 2."""
  return [
    [
      [sum(counts[c * n_keys**2 + i * n_keys + j] for j in range(n_keys)) for i in range(n_keys)],
      [sum(counts[c * n_keys**2 + i * n_keys + j] for i in range(n_keys)) for j in range(n_keys)],
    ]
    for c in range(channels)
  ]


@pytest.mark.parametrize("ffn_type", ["sgatlin", "peer"])
def test_a_step_moves_the_subkey_bias_by_the_rule(ffn_type):
  """Product keys: a bias per sub-key of each half (per channel for sgatlin's own tables, one for PEER's shared
  table), moved against each half's picks, the halves and channels balanced apart."""
  config = micro_config(ffn_type, warmup_steps=0)
  config.model.ffn.bias_update_rate = RATE
  before, after, _ = run_step(config, edit=biased_params)
  n_keys = int(np.sqrt(config.model.ffn.d_ffw))
  channels = config.model.ffn.n_channels if ffn_type == "sgatlin" else 1
  biases, moved = selection_bias.split(before.params)[1], selection_bias.split(after.params)[1]
  assert sorted(biases) == [(f"layers_{i}", "mlp", "router", selection_bias.NAME) for i in range(2)]
  for path, bias in biases.items():
    loads = subkey_loads_by_hand(list(after.usage[path[0]]), channels, n_keys)
    want = [
      [rule_by_hand(b, x, RATE) for b, x in zip(bc, lc)] for bc, lc in zip(bias.reshape(channels, 2, n_keys), loads)
    ]
    np.testing.assert_allclose(moved[path], np.reshape(want, bias.shape), rtol=0, atol=1e-6)


def test_the_subkey_bias_picks_and_the_gates_ignore_it():
  """A bias of +100 on sub-key 3 of each channel's first half: every pick lies in row 3 of the product grid, and the
  gate is the unbiased s1[3] + s2[j]."""
  from sparsetx.models.ffn.product_keys import ProductKeyRouter  # noqa: PLC0415

  router = ProductKeyRouter(d_ffw=16, n_channels=2, top_k=2, d_key=4, bias_shape=(2, 2, 4))
  x = jax.random.normal(jax.random.key(0), (2, 5, 8))
  params = init_params(router, x)
  params[selection_bias.NAME] = jnp.zeros((2, 2, 4)).at[:, 0, 3].set(100.0)
  values, ids = jax.jit(router.apply)({"params": params}, x)
  ids = np.asarray(ids)
  assert (ids // 4 == 3).all()
  query = np.asarray(x, np.float64) @ np.asarray(params["query"]["kernel"], np.float64)
  scores = np.einsum("btq,qscn->btscn", query, np.asarray(params["keys"]["kernel"], np.float64))  # [B, T, 2, C, 4]
  want = np.take_along_axis(scores[:, :, 0], ids // 4, -1) + np.take_along_axis(scores[:, :, 1], ids % 4, -1)
  np.testing.assert_allclose(np.asarray(values), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ffn_type", ["sgatlin", "peer"])
def test_export_applies_the_subkey_bias(ffn_type, tmp_path):
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import torch  # noqa: PLC0415
  from export_checks import random_params  # noqa: PLC0415

  from sparsetx.hf import export  # noqa: PLC0415

  config = micro_config(ffn_type)
  config.model.ffn.bias_update_rate = RATE
  params = biased_params(random_params(config.model), seed=3)
  tokens = np.random.default_rng(1).integers(0, config.model.vocab_size, (2, config.model.max_len)).astype(np.int32)
  apply = jax.jit(Transformer(ml_collections.FrozenConfigDict(config.model)).apply)
  expected = np.asarray(apply({"params": params}, tokens))
  rest, biases = selection_bias.split(params)
  unbiased = selection_bias.merge(rest, {path: 0 * b for path, b in biases.items()})
  assert np.abs(np.asarray(apply({"params": unbiased}, tokens)) - expected).max() > 1e-2  # the bias matters here
  export.write_hf(config, params, str(tmp_path / "hf"))
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)
  with torch.no_grad():
    logits = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)

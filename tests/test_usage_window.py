"""Sparse layers' usage over a window (sparsetx/train/tracking/usage_window.py): each statistic against NumPy written from
its definition, on hand-built counts with known dead units and a collapsed sub-key; the device load against its
definition on split meshes, and from a real run's metrics; the step's counts against a bincount of the units its layers
routed, for every sparse type; the counts through a checkpoint."""

import json
import math

import jax
import numpy as np
import pytest
from conftest import synthetic_batch
from test_train import micro_config

from sparsetx import config as config_lib
from sparsetx.models.ffn.registry import SPECS
from sparsetx.parallel import logical_rules
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import loss as loss_lib
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib
from sparsetx.train.checkpoints import checkpointing
from sparsetx.train.run import loop
from sparsetx.train.tracking import usage_window


def reference(counts, n_keys=None, tree=None) -> dict:
  """The statistics from their definitions, unit by unit."""
  counts = [float(c) for c in counts]
  n, total = len(counts), sum(counts)
  found = dict(
    dead=sum(c == 0 for c in counts) / n,
    usage=sum(c > 0 for c in counts) / n,  # Lample et al. 2019: slots accessed at least once
    kl_uniform=sum(c / total * math.log((c / total) / (1 / n)) for c in counts if c > 0),
    gini=sum(abs(a - b) for a in counts for b in counts) / (2 * n * total),  # mean absolute difference / 2 mean
    max_load=max(counts) / (total / n),
    device_load=1.0,  # one device holds every unit: its work is the mean
    load_devices=1.0,
  )
  if n_keys is not None:  # neuron i * n_keys + j of each channel: sub-key i of half 1, j of half 2
    channels = n // n_keys**2
    rows = [
      [sum(counts[c * n_keys**2 + i * n_keys + j] for j in range(n_keys)) for i in range(n_keys)]
      for c in range(channels)
    ]
    cols = [
      [sum(counts[c * n_keys**2 + i * n_keys + j] for i in range(n_keys)) for j in range(n_keys)]
      for c in range(channels)
    ]
    found["dead_subkeys_half1"] = sum(r == 0 for row in rows for r in row) / (channels * n_keys)
    found["dead_subkeys_half2"] = sum(r == 0 for col in cols for r in col) / (channels * n_keys)
  if tree is not None:
    n_trees, depth = tree
    nodes = 2 ** (depth + 1) - 1
    shares, entropies = [], []
    for t in range(n_trees):
      leaves = counts[t * nodes + 2**depth - 1 : (t + 1) * nodes]
      p = [leaf / sum(leaves) for leaf in leaves]
      shares.append(max(p))
      entropies.append(-sum(q * math.log2(q) for q in p if q > 0))
    found["top_leaf_share"] = sum(shares) / n_trees
    found["path_entropy"] = sum(entropies) / n_trees
  return found


def device_load_reference(unit_counts, n_devices: int) -> float:
  """Device g holds units [g * U / G, (g + 1) * U / G) (a contiguous block, as NamedSharding splits the unit axis);
  its work is their picks; the busiest device's over the mean device's."""
  per = len(unit_counts) // n_devices
  work = [sum(float(c) for c in unit_counts[g * per : (g + 1) * per]) for g in range(n_devices)]
  return max(work) / (sum(work) / n_devices)


def ffn(ffn_type: str, **fields) -> config_lib.ml_collections.ConfigDict:
  config = micro_config(ffn_type)
  config.model.ffn.update(fields)
  return config_lib.layer_ffn_config(config.model, 0)


@pytest.mark.parametrize(
  "ffn_type, fields, size",
  [
    ("sgatlin", dict(d_ffw=16, n_channels=2, top_k=2), 32),
    ("peer", dict(d_ffw=16), 16),
    ("moe", dict(n_experts=8, experts_per_token=2), 8),
    ("fff", dict(depth=2, n_trees=2), 14),
  ],
)
def test_each_statistic_is_its_definition_on_dead_units_and_a_collapsed_subkey(ffn_type, fields, size):
  rng = np.random.default_rng(0)
  counts = rng.integers(0, 5, size).astype(np.float32)
  counts[:3] = 0  # known dead units
  counts[5] = 40  # one unit takes much of the load
  if ffn_type == "sgatlin":  # channel 1: every pick under sub-key 2 of the first half (a collapsed router)
    counts[16:] = 0
    counts[16 + 2 * 4 : 16 + 3 * 4] = [7, 0, 3, 1]
  layer = ffn(ffn_type, **fields)
  expected = reference(
    counts,
    n_keys=4 if ffn_type in ("sgatlin", "peer") else None,
    tree=(2, 2) if ffn_type == "fff" else None,
  )
  got = usage_window.stats(layer, counts)
  assert got.keys() == expected.keys()
  for name, value in expected.items():
    assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name
  if ffn_type == "sgatlin":
    assert got["dead_subkeys_half1"] >= 3 / 8  # channel 1's other three rows are dead


@pytest.mark.parametrize(
  "ffn_type, microbatches",
  [
    ("sgatlin", 1),
    pytest.param("moe", 2, marks=pytest.mark.long),  # micro-batches: the counts summed, not averaged
    pytest.param("peer", 1, marks=pytest.mark.long),  # a compile each: the step's counting is the same code
    pytest.param("fff", 1, marks=pytest.mark.long),
  ],
)
def test_a_step_adds_what_its_layers_routed(ffn_type, microbatches):
  """The state's counts after one step from zero: a bincount of the routed unit ids of the step's forward, each
  real token once (padding weighs 0), summed over the micro-batches."""
  config = micro_config(ffn_type, microbatches=microbatches)
  config.model.n_layers = 1
  built = state_lib.setup(config, mesh=state_lib.single_device_mesh(config))
  state = state_lib.create_state(config, built.shardings, built.model, built.tx)
  batch = synthetic_batch(config)
  intermediates = jax.jit(lambda p, b: loss_lib.token_losses(built.model, p, b, 0.0)[1])(state.params, batch)
  layer = config_lib.layer_ffn_config(config.model, 0)
  circuit = SPECS[ffn_type].circuit
  ids_BTS = np.asarray(
    circuit.usage_ids(layer, circuit.ids(layer, np.asarray(intermediates["layers_0"]["mlp"][circuit.units][0])))
  )
  weights_BTS = np.broadcast_to(batch["loss_weights"][..., None], ids_BTS.shape)
  expected = np.bincount(ids_BTS.reshape(-1), weights_BTS.reshape(-1), circuit.usage_units(layer))
  step = step_lib.make_train_step(config, built)
  with logical_rules.activate(built.mesh, config.mesh.rules):
    new_state, _ = step(state, jax.device_put(batch, built.batch_sharding))
  np.testing.assert_array_equal(np.asarray(new_state.usage["layers_0"]), expected.astype(np.float32))


def test_the_counts_are_checkpointed_with_the_state(tmp_path):
  """A resume continues the window with the counts it stopped with; a step saved without them starts them empty."""
  config = micro_config("sgatlin")
  built = state_lib.setup(config, mesh=state_lib.single_device_mesh(config))
  state = state_lib.create_state(config, built.shardings, built.model, built.tx)
  counts = {name: np.arange(c.size, dtype=np.float32) for name, c in state.usage.items()}
  state = state.replace(usage=jax.device_put(counts, built.shardings.usage))
  checkpointer = checkpointing.Checkpointer(str(tmp_path), config.checkpoint)
  checkpointer.save(3, state, config, data_state=None)
  checkpointer.wait()
  restored = checkpointer.restore_state(3, built.abstract_state)
  checkpointer.close()
  for name in counts:
    np.testing.assert_array_equal(np.asarray(restored.usage[name]), counts[name])


def mesh_of(**axes):
  config = micro_config("mlp")
  config.mesh.ici.update(dict(data=1, fsdp=1, tensor=1, expert=1) | axes)
  n = math.prod(axes.values())
  return mesh_lib.make_mesh(config.mesh, jax.devices()[:n])


@pytest.mark.parametrize("expert", [2, 4])
def test_device_load_is_the_busiest_contiguous_expert_block_over_the_mean(expert):
  """MoE's 8 experts over expert=2 or 4 of a data x expert mesh, skewed counts: the layer's split comes from its
  placement on the mesh, the load from the counts of each device's block of experts."""
  config = micro_config("moe")
  config.model.ffn.update(n_experts=8, placement="expert")
  mesh = mesh_of(data=2, expert=expert)
  assert usage_window.devices(config, mesh) == {"layers_0": expert, "layers_1": expert}
  counts_E = np.array([50, 3, 0, 7, 1, 1, 20, 2], np.float32)  # blocks of 2 experts: 53, 7, 2, 22
  got = usage_window.stats(config_lib.layer_ffn_config(config.model, 0), counts_E, expert)
  assert got["device_load"] == pytest.approx(device_load_reference(counts_E, expert), rel=1e-12)
  assert got["device_load"] == pytest.approx({2: 60 / 42, 4: 53 / 21}[expert], rel=1e-12)
  assert got["load_devices"] == expert and got["max_load"] == pytest.approx(50 / 10.5)


def test_an_unsplit_layer_or_one_balanced_by_construction_loads_every_device_alike():
  """Tables whole on every device (placement fsdp), PEER's shared table and a one-device mesh: one block, load 1.
  sgatlin's channels over expert=2: every token picks top_k in each channel, so the blocks' work is equal although
  the neurons inside are skewed; the load says so from the counts."""
  mesh = mesh_of(data=2, expert=2)
  moe = micro_config("moe")
  moe.model.ffn.update(n_experts=8, placement="fsdp")
  assert usage_window.devices(moe, mesh) == {"layers_0": 1, "layers_1": 1}
  assert usage_window.devices(micro_config("peer"), mesh) == {"layers_0": 1, "layers_1": 1}
  moe.model.ffn.placement = "expert"
  assert usage_window.devices(moe, mesh_of(data=1)) == {"layers_0": 1, "layers_1": 1}
  counts_E = np.array([50, 3, 0, 7, 1, 1, 20, 2], np.float32)
  assert usage_window.stats(config_lib.layer_ffn_config(moe.model, 0), counts_E, 1)["device_load"] == 1.0

  sgatlin = micro_config("sgatlin")
  sgatlin.model.ffn.update(d_ffw=16, n_channels=2, top_k=2, placement="expert")
  assert usage_window.devices(sgatlin, mesh) == {"layers_0": 2, "layers_1": 2}
  counts = np.zeros(32, np.float32)
  counts[[0, 5]] = [90, 10]  # channel 0: two neurons take its 100 picks
  counts[16:] = 100 / 16  # channel 1: spread evenly
  got = usage_window.stats(config_lib.layer_ffn_config(sgatlin.model, 0), counts, 2)
  assert got["device_load"] == pytest.approx(1.0) and got["max_load"] == pytest.approx(90 / (200 / 32))
  counts[16:] *= 3  # a channel picked more than another (not sgatlin's routing): the load follows the counts
  got = usage_window.stats(config_lib.layer_ffn_config(sgatlin.model, 0), counts, 2)
  assert got["device_load"] == pytest.approx(device_load_reference([100, 300], 2)) == 1.5


@pytest.mark.long  # a 4-step run: about 20 s on 2 cores
def test_a_tiny_moe_run_on_a_data_x_expert_mesh_logs_its_device_load(tmp_path):
  """A short run of MoE on data=4 x expert=2 (its experts placed by expert): every window's device_load in
  metrics.jsonl, and the last one's from the counts it kept (usage_last_window.npz) by the definition."""
  config = micro_config("moe", steps=4, usage_window=2, log_every=1)
  config.model.n_layers = 1
  config.model.ffn.update(n_experts=8, placement="expert")
  config.mesh.ici.update(data=4, fsdp=1, tensor=1, expert=2)
  loop.train(config, str(tmp_path))
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  windows = [row for row in rows if "usage/layers_0/device_load" in row]
  assert [row["step"] for row in windows] == [2, 4]
  last = np.load(tmp_path / usage_window.LAST_WINDOW)
  assert int(last["step"]) == 4
  assert windows[-1]["usage/layers_0/load_devices"] == 2
  want = device_load_reference(last["layers_0"], 2)
  assert windows[-1]["usage/layers_0/device_load"] == pytest.approx(want, rel=1e-6)
  assert 1.0 < want <= windows[-1]["usage/layers_0/max_load"]  # 4 steps of an untrained router: not balanced

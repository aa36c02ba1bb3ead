"""Bad steps at the jitted step, as the loop runs it: a run that skips nothing is bitwise the `stop` run (the select
kept out of the update's kernels: bad_steps.keep_old_if), and a skipped step, spiked or NaN, leaves the parameters,
the optimizer state and the usage counts bitwise as they were, while an applied one adds a bincount of the units
its layers routed."""

import functools

import jax
import numpy as np
import pytest
from conftest import synthetic_batch
from test_train import micro_config

from sparsetx import config as config_lib
from sparsetx.models.ffn.registry import SPECS
from sparsetx.parallel import logical_rules
from sparsetx.train import loss as loss_lib
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib


@functools.cache
def compiled(ffn_type: str, mode: str):
  """(config, setup, jitted step) of a one-layer micro model on one device under config.train.bad_steps=`mode`
  (the first moments differ there too without the barrier); a compile per pair."""
  config = micro_config(ffn_type, warmup_steps=0, bad_steps=mode, spike_window=4)
  config.model.n_layers = 1
  built = state_lib.setup(config, mesh=state_lib.single_device_mesh(config))
  return config, built, step_lib.make_train_step(config, built)


def step(ffn_type, mode, host_state, batch):
  """(state after one step, metrics), both on the host, from a state on the host (the step donates its input)."""
  config, built, step_fn = compiled(ffn_type, mode)
  with logical_rules.activate(built.mesh, config.mesh.rules):
    state, metrics = step_fn(jax.device_put(host_state, built.shardings), jax.device_put(batch, built.batch_sharding))
  return jax.device_get(state), jax.device_get(metrics)


@functools.cache
def initial_state(ffn_type):
  """The step-0 state of config.train.seed, on the host."""
  config, built, _ = compiled(ffn_type, "skip")
  return jax.device_get(state_lib.create_state(config, built.shardings, built.model, built.tx))


def first_state(ffn_type, mode):
  """The step-0 state as `mode`'s step takes it: its model and optimizer are part of the tree's type."""
  _, built, _ = compiled(ffn_type, mode)
  return initial_state(ffn_type).replace(apply_fn=built.model.apply, tx=built.tx)


def assert_bitwise(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(x, y, strict=True)


@pytest.mark.parametrize("ffn_type", ["mlp", "sgatlin"])
def test_a_run_that_skips_nothing_is_bitwise_the_stop_run(ffn_type):
  # Without the barrier XLA CPU contracted the other product of AdamW's b1 * mu + (1 - b1) * g into an FMA once the
  # select joined the kernel: the first moments and the parameters differed from step 2 on (mu is 0 before step 1,
  # where both roundings agree).
  config = compiled(ffn_type, "stop")[0]
  states = {mode: first_state(ffn_type, mode) for mode in ("stop", "skip")}
  for s in range(3):
    batch = synthetic_batch(config, seed=s)
    metrics = {}
    for mode in states:
      states[mode], metrics[mode] = step(ffn_type, mode, states[mode], batch)
    assert metrics["skip"]["skipped"] == 0.0 and metrics["skip"]["loss"] == metrics["stop"]["loss"]
  stop, skip = states["stop"], states["skip"]
  assert_bitwise((stop.params, stop.opt_state, stop.usage), (skip.params, skip.opt_state, skip.usage))


@functools.cache
def forward(ffn_type):
  """The model's forward as the loss runs it: (params, batch) -> its intermediates (each layer's routed units)."""
  model = compiled(ffn_type, "skip")[1].model
  return jax.jit(lambda p, b: loss_lib.token_losses(model, p, b, 0.0)[1])


def routed_counts(ffn_type, params, batch) -> dict[str, np.ndarray]:
  """{'layers_i': a bincount of the units layer i routed its real tokens to} (padding weighs 0), from the model's
  forward alone (as tests/test_usage_window.py derives them)."""
  config = compiled(ffn_type, "skip")[0]
  intermediates = forward(ffn_type)(params, batch)
  counts = {}
  for i in range(config.model.n_layers):
    layer = config_lib.layer_ffn_config(config.model, i)
    circuit = SPECS[layer.type].circuit
    units = np.asarray(intermediates[f"layers_{i}"]["mlp"][circuit.units][0])
    ids_BTS = np.asarray(circuit.usage_ids(layer, circuit.ids(layer, units)))
    weights_BTS = np.broadcast_to(batch["loss_weights"][..., None], ids_BTS.shape)
    counts[f"layers_{i}"] = np.bincount(ids_BTS.reshape(-1), weights_BTS.reshape(-1), circuit.usage_units(layer))
  return counts


def test_a_skipped_step_leaves_parameters_optimizer_state_and_usage_bitwise_and_an_applied_one_counts():
  config = compiled("sgatlin", "skip")[0]
  before, _ = step("sgatlin", "skip", initial_state("sgatlin"), synthetic_batch(config, seed=0))  # usage not zero
  batch = synthetic_batch(config, seed=1)
  # A spike: a full window of zero losses and norms puts both limits at 0, so this finite step is skipped.
  window = np.zeros_like(before.health.losses_W)
  spiked = before.replace(
    health=before.health.replace(losses_W=window, grad_norms_W=window, accepted=np.int32(window.size))
  )
  # A poisoned batch: one NaN weight makes the loss, the gradients and the weighted counts NaN.
  poisoned = dict(batch, loss_weights=batch["loss_weights"].copy())
  poisoned["loss_weights"][1, 3] = np.nan
  for state, feed, reason in ((spiked, batch, "spike"), (before, poisoned, "NaN")):
    after, metrics = step("sgatlin", "skip", state, feed)
    assert metrics["skipped"] == 1.0 and int(after.step) == int(state.step) + 1, reason
    assert int(after.health.skipped) == int(state.health.skipped) + 1, reason
    assert_bitwise((state.params, state.opt_state, state.usage), (after.params, after.opt_state, after.usage))
  assert not np.isfinite(metrics["loss"]) and any(
    np.isnan(c).any() for c in routed_counts("sgatlin", before.params, poisoned).values()
  )
  after, metrics = step("sgatlin", "skip", before, batch)
  assert metrics["skipped"] == 0.0
  added = routed_counts("sgatlin", before.params, batch)
  assert added.keys() == after.usage.keys() and all(c.sum() > 0 for c in added.values())
  for name, counts in added.items():
    np.testing.assert_array_equal(after.usage[name], before.usage[name] + counts.astype(np.float32))

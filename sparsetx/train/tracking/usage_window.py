"""Sparse layers' usage over a window of steps: which units were never picked, and how unevenly the rest were.

Each step adds the counts it already computes for its per-step stats (sparse_stats.py) to the train state's
`usage` (one float32 vector per sparse layer; no host transfer, no collective beyond the step's own). Every
config.train.usage_window steps (and at the run's last step) the loop reads the vectors, logs `usage/layers_i/*`
and resets them. They are checkpointed with the state: a resume continues the window it stopped in, with the
counts the uninterrupted run would have. The units (each statistic's definition and source: README):
  sgatlin: each channel's neurons (n_channels x d_ffw); PEER: the shared table's neurons; MoE: experts;
  FFF: each tree's nodes (heap order), the leaves the last half; device_load: per device of the run's mesh
  that splits them (placement.unit_axes). More: docs/modules.md.
"""

import io

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from sparsetx import config as config_lib
from sparsetx import paths
from sparsetx.models.ffn import placement
from sparsetx.models.ffn.registry import SPECS
from sparsetx.parallel import per_device
from sparsetx.plan import step_cost

COUNTS = "usage_counts/"  # the per-step stats' key prefix of a layer's counts (popped by the step)


def sparse_layers(model_cfg) -> dict[str, ml_collections.ConfigDict]:
  """{'layers_i': its ffn config} of the layers whose type taps a circuit."""
  layers = {}
  for i in range(model_cfg.n_layers):
    ffn = config_lib.layer_ffn_config(model_cfg, i)
    spec = SPECS.get(ffn.type)
    if spec is not None and spec.circuit is not None:
      layers[f"layers_{i}"] = ffn
  return layers


def fresh(model_cfg) -> dict[str, jax.Array]:
  """Zero counts for every sparse layer: a window's start."""
  return {
    name: jnp.zeros((SPECS[ffn.type].circuit.usage_units(ffn),), jnp.float32)
    for name, ffn in sparse_layers(model_cfg).items()
  }


def window(train: ml_collections.ConfigDict) -> int:
  """config.train.usage_window, or derived (None): 10 log intervals, at most the run, a multiple of log_every."""
  given = train.get("usage_window")
  if given is not None:
    return given
  return max(train.log_every, min(10 * train.log_every, train.steps // train.log_every * train.log_every))


def devices(config, mesh) -> dict[str, int]:
  """{'layers_i': the devices its units are split over on `mesh`, in contiguous blocks} of every sparse layer: the
  product of the mesh axes placement.unit_axes gives it under the placement the trainer resolves for the mesh (1:
  its tables whole on every device, or a type without units)."""
  resolved = step_cost.resolve_placements(config, dict(mesh.shape))
  return {
    name: per_device.shards(mesh, placement.unit_axes(resolved, mesh, ffn))
    for name, ffn in sparse_layers(resolved.model).items()
  }


def device_load(ffn, counts_U, n_devices: int) -> float:
  """The busiest device's routed work over the mean device's: each of `n_devices` holds a contiguous block of the
  layer's units (Units.counts) and does its units' picks. The window's counts are summed over the data-parallel
  replicas, so this is the load of the busiest unit block over the whole batch; 1 when the blocks are balanced
  (sgatlin's channels, FFF's trees: every token picks the same number in each) or there is one block."""
  units_U = SPECS[ffn["type"]].units.counts(ffn, counts_U) if n_devices > 1 else np.asarray(counts_U, np.float64)
  work_G = units_U.reshape(n_devices, -1).sum(1)
  return float(work_G.max() / max(work_G.mean(), 1e-30))


def stats(ffn, counts_U, n_devices: int = 1) -> dict[str, float]:
  """One window's statistics of a layer from its counts (numpy), its units split over `n_devices` (`devices`)."""
  counts_U = np.asarray(counts_U, np.float64)
  total = counts_U.sum()
  p_U = counts_U / max(total, 1e-30)
  n = counts_U.size
  found = dict(
    dead=float((counts_U == 0).mean()),
    usage=float((counts_U > 0).mean()),
    kl_uniform=float(np.sum(np.where(p_U > 0, p_U * np.log(np.where(p_U > 0, p_U * n, 1.0)), 0.0))),
    gini=gini(counts_U),
    max_load=float(counts_U.max() / max(total / n, 1e-30)),
    device_load=device_load(ffn, counts_U, n_devices),
    load_devices=float(n_devices),
  )
  by_type = SPECS[ffn["type"]].window_stats  # what the type's units add: sub-keys, leaves
  return found | (by_type(ffn, counts_U) if by_type else {})


def gini(counts) -> float:
  """Gini coefficient of non-negative counts: 0 uniform, (n - 1) / n one unit takes all."""
  sorted_U = np.sort(np.asarray(counts, np.float64))
  n, total = sorted_U.size, sorted_U.sum()
  if total <= 0:
    return 0.0
  return float((2 * np.arange(1, n + 1) - n - 1).dot(sorted_U) / (n * total))


LAST_WINDOW = "usage_last_window.npz"  # <workdir>/: the last window's counts, per layer (sparsetx-usage draws them)


class Reader:
  """Reads a window's counts from the state, logs them (and keeps them in <workdir>/LAST_WINDOW), and gives back
  the state with the counts reset."""

  def __init__(self, model_cfg, shardings: dict, workdir: str, n_devices: dict[str, int] | None = None):
    self._model_cfg, self._workdir, self._devices = model_cfg, paths.resolve(workdir), n_devices
    self._zeros = jax.jit(lambda: fresh(model_cfg), out_shardings=shardings)

  def read(self, step: int, state, writer):
    usage = jax.device_get(state.usage)  # waits for `step`: once a window
    writer.write_scalars(step, metrics(self._model_cfg, usage, self._devices))
    writer.write_histograms(step, {f"usage/{name}/counts": counts for name, counts in usage.items()})
    if jax.process_index() == 0:
      buffer = io.BytesIO()
      np.savez(buffer, step=step, **usage)
      with paths.writing(f"writing {self._workdir / LAST_WINDOW}", paths.FREE_SPACE):
        paths.write_bytes_atomically(self._workdir / LAST_WINDOW, buffer.getvalue())
    return state.replace(usage=self._zeros())


def metrics(model_cfg, usage: dict, n_devices: dict[str, int] | None = None) -> dict[str, float]:
  """{'usage/layers_i/<stat>': value} of a window's counts (read from the device); `n_devices`: `devices` of the
  run's mesh (None: one device)."""
  layers, n_devices = sparse_layers(model_cfg), n_devices or {}
  return {
    f"usage/{name}/{stat}": value
    for name, counts in usage.items()
    for stat, value in stats(layers[name], np.asarray(jax.device_get(counts)), n_devices.get(name, 1)).items()
  }

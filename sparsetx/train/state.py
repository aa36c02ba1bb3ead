"""The train state, created already sharded: no full copy of any parameter on one host.

The model is initialized under `jax.eval_shape` to learn every leaf's shape and logical axes; the
real initialization then runs inside `jit` with `out_shardings`, so each device materializes only
its own shards. `setup` builds what every program that runs the model builds first (the train loop,
the ahead-of-time compile, evaluation): the checked mesh, the model, the optimizer and the abstract
sharded state.
"""

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from flax.training import train_state

from sparsetx import config as config_lib
from sparsetx.kernels import registry
from sparsetx.models.ffn import placement
from sparsetx.models.transformer import Transformer
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.parallel import per_device
from sparsetx.plan import step_cost
from sparsetx.train import bad_steps
from sparsetx.train.optimizer import make_optimizer
from sparsetx.train.tracking import usage_window


class TrainState(train_state.TrainState):
  """Step, float32 master params, optimizer state (apply_fn and tx are static), the bad-step record
  (bad_steps.Health: the spike test's window) and the sparse layers' usage counts of the current window
  (usage_window.py), both checkpointed with the rest."""

  health: bad_steps.Health
  usage: dict


def new_state(model, params, tx, train: ml_collections.ConfigDict) -> TrainState:
  """A step-0 state around `params`: fresh optimizer state, an empty bad-step record and zero usage counts."""
  state = TrainState.create(
    apply_fn=model.apply, params=params, tx=tx, health=bad_steps.fresh(train), usage=usage_window.fresh(model.cfg)
  )
  # A strong int32 step, as a restored one is: a step jitted on a fresh state is not traced again after a restore.
  return state.replace(step=jnp.zeros((), jnp.int32))


def build_model(config: ml_collections.ConfigDict) -> Transformer:
  return Transformer(ml_collections.FrozenConfigDict(config.model))


def _init(model, tx, config, rng):
  tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
  return new_state(model, model.init(rng, tokens)["params"], tx, config.train)


def state_shardings(config: ml_collections.ConfigDict, mesh):
  """(abstract unboxed state with shardings, its NamedShardings, model, optimizer). The model's sparse tables are
  placed for this mesh (config.model.ffn.placement "auto": step_cost.resolve_placements), so every program that
  lays out a state for a mesh lays it out alike."""
  config = step_cost.resolve_placements(config, dict(mesh.shape))
  model, tx = build_model(config), make_optimizer(config.train, config.model)
  init = functools.partial(_init, model, tx, config)
  boxed = jax.eval_shape(lambda: init(jax.random.key(0)))  # the key inside: nothing runs eagerly
  shardings = mesh_lib.logical_sharding(nn.get_partition_spec(boxed), mesh, config.mesh.rules)
  abstract = jax.tree.map(
    lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), nn.unbox(boxed), shardings
  )
  mesh_lib.check_not_replicated(shardings.params, abstract.params, mesh, config.mesh.max_replicated_mib)
  return abstract, shardings, model, tx


def state_from_params(params, shardings, model, tx, train: ml_collections.ConfigDict) -> TrainState:
  """A step-0 state around given params (a sparsified start): fresh optimizer state, laid out as `shardings`."""
  return jax.jit(lambda p: new_state(model, p, tx, train), out_shardings=shardings)(params)


def create_state(config: ml_collections.ConfigDict, shardings, model, tx) -> TrainState:
  init = functools.partial(_init, model, tx, config)
  rng = jax.random.key(config.train.seed)
  return jax.jit(lambda r: nn.unbox(init(r)), out_shardings=shardings)(rng)


class Setup(NamedTuple):
  """What `setup` builds: the mesh, the model and optimizer, the abstract state and the shardings."""

  mesh: jax.sharding.Mesh
  model: Transformer
  tx: object  # optax.GradientTransformation
  abstract_state: TrainState  # ShapeDtypeStructs carrying their shardings
  shardings: TrainState  # NamedShardings of the state
  batch_sharding: jax.sharding.NamedSharding


def check_batch_divides(config: ml_collections.ConfigDict, mesh) -> None:
  axes = mesh_lib.batch_axes(mesh, config.mesh.rules)
  shards = per_device.shards(mesh, axes)
  for field in ("global_batch_size", "eval_batch_size"):
    size = config.data[field]
    if size % shards:
      raise config_lib.ConfigError(
        f"config.data.{field}={size} is not divisible by the {shards} batch shards of the mesh "
        f"({' x '.join(f'{a}={mesh.shape[a]}' for a in axes)}); use a multiple of {shards}."
      )
  micro = config.data.global_batch_size // config.train.microbatches
  if micro % shards:
    raise config_lib.ConfigError(
      f"config.train.microbatches={config.train.microbatches} leaves {micro} rows per micro-batch, not divisible "
      f"by the {shards} batch shards; use fewer micro-batches or a larger config.data.global_batch_size."
    )


def checked_mesh(config: ml_collections.ConfigDict, devices=None, granules: int | None = None):
  """config.mesh over `devices` (default: all; `granules` simulated nodes / slices, see mesh_lib.make_mesh),
  refused in one sentence when the batch or the sparse layers' units do not divide over it."""
  mesh = mesh_lib.make_mesh(config.mesh, devices, granules)
  check_batch_divides(config, mesh)
  placement.check_units_divide(step_cost.resolve_placements(config, dict(mesh.shape)), mesh)
  return mesh


def single_device_mesh(config: ml_collections.ConfigDict):
  """config.mesh (its rules) on the first device: every axis of size 1."""
  mesh_config = config.mesh.copy_and_resolve_references()
  mesh_config.ici.update(data=1, fsdp=1, tensor=1, expert=1)
  mesh_config.dcn.update(data=1, fsdp=1, tensor=1, expert=1)
  return mesh_lib.make_mesh(mesh_config, jax.devices()[:1])


def setup(config: ml_collections.ConfigDict, devices=None, mesh=None) -> Setup:
  """The mesh, the model, the optimizer and the abstract state with its shardings, as the train loop builds
  them; nothing is allocated. The mesh is config.mesh over `devices` (default: all), checked by `checked_mesh`,
  or `mesh` as given (the ahead-of-time compile's target, possibly abstract), of which only the sparse layers'
  units are checked: the batch sizes there are the caller's."""
  for section in ("ffn", "dense_ffn"):  # the kernels a config names are the registry's
    if "kernel" in config.model.get(section, {}):
      registry.check_config(config.model[section].kernel, f"config.model.{section}.kernel.implementation")
  if mesh is None:
    mesh = mesh_lib.make_mesh(config.mesh, devices)
    check_batch_divides(config, mesh)
  config = step_cost.resolve_placements(config, dict(mesh.shape))  # the plan, once; every later call sees it
  placement.check_units_divide(config, mesh)
  abstract, shardings, model, tx = state_shardings(config, mesh)
  return Setup(mesh, model, tx, abstract, shardings, mesh_lib.batch_sharding(mesh, config.mesh.rules))

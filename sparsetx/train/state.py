"""The train state, created already sharded: no full copy of any parameter on one host.

The model is initialized under `jax.eval_shape` to learn every leaf's shape and logical axes; the
real initialization then runs inside `jit` with `out_shardings`, so each device materializes only
its own shards.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from flax.training import train_state

from sparsetx.models.transformer import Transformer
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train.optimizer import make_optimizer


class TrainState(train_state.TrainState):
  """Step, float32 master params and optimizer state (apply_fn and tx are static)."""


def build_model(config: ml_collections.ConfigDict) -> Transformer:
  return Transformer(ml_collections.FrozenConfigDict(config.model))


def _init(model, tx, seq_len, rng):
  tokens = jnp.zeros((1, seq_len), jnp.int32)
  params = model.init(rng, tokens)["params"]
  return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def state_shardings(config: ml_collections.ConfigDict, mesh):
  """(abstract unboxed state with shardings, its NamedShardings, model, optimizer)."""
  model, tx = build_model(config), make_optimizer(config.train, config.model)
  init = functools.partial(_init, model, tx, config.data.seq_len)
  boxed = jax.eval_shape(init, jax.random.key(0))
  shardings = mesh_lib.logical_sharding(nn.get_partition_spec(boxed), mesh, config.mesh.rules)
  abstract = jax.tree.map(
    lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), nn.unbox(boxed), shardings
  )
  mesh_lib.check_not_replicated(shardings.params, abstract.params, mesh, config.mesh.max_replicated_mib)
  return abstract, shardings, model, tx


def state_from_params(params, shardings, model, tx) -> TrainState:
  """A step-0 state around given params (a sparsified start): fresh optimizer state, laid out as `shardings`."""
  return jax.jit(lambda p: TrainState.create(apply_fn=model.apply, params=p, tx=tx), out_shardings=shardings)(params)


def create_state(config: ml_collections.ConfigDict, shardings, model, tx) -> TrainState:
  init = functools.partial(_init, model, tx, config.data.seq_len)
  rng = jax.random.key(config.train.seed)
  return jax.jit(lambda r: nn.unbox(init(r)), out_shardings=shardings)(rng)

"""An export's tensors made one at a time: each HF tensor names the parameter arrays it is made of and how.

A writer reads only those arrays (from a checkpoint, on the host) when it writes that tensor, so an export holds one
shard and one tensor's sources at a time, never the model. Shapes come from the recipe traced abstractly (`xp` is
jax.numpy there and numpy when made), so shards are planned before anything is read.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import linen as nn
from flax import traverse_util

Path = tuple[str, ...]  # a flax parameter path: ('layers_0', 'attention', 'query', 'kernel')


@dataclasses.dataclass(frozen=True)
class HfTensor:
  sources: tuple[Path, ...]  # the parameter arrays it is made of
  make: Callable = lambda xp, x: x  # (xp, *sources) -> the tensor; xp is numpy or jax.numpy


def shapes(tensors: dict[str, HfTensor], source_shapes: dict[Path, tuple]) -> dict[str, tuple]:
  """{HF name: shape} of every tensor, from the shapes of its sources alone (nothing is read or computed)."""
  found = {}
  for name, tensor in tensors.items():
    abstract = [jax.ShapeDtypeStruct(source_shapes[path], jnp.float32) for path in tensor.sources]
    found[name] = tuple(jax.eval_shape(lambda *xs, t=tensor: t.make(jnp, *xs), *abstract).shape)
  return found


def made(tensor: HfTensor, arrays: dict[Path, np.ndarray]) -> np.ndarray:
  """The tensor in float32, C-contiguous, from its sources in `arrays`."""
  return np.ascontiguousarray(np.asarray(tensor.make(np, *(arrays[path] for path in tensor.sources)), np.float32))


def tree_reader(params) -> Callable[[list[Path]], dict[Path, np.ndarray]]:
  """`read` over a param tree in memory (numpy or jax arrays, boxed or not): {path: array} of the paths asked."""
  flat = traverse_util.flatten_dict(nn.unbox(params))
  return lambda wanted: {path: np.asarray(flat[path]) for path in wanted}


def tree_shapes(params) -> dict[Path, tuple]:
  return {path: tuple(np.shape(leaf)) for path, leaf in traverse_util.flatten_dict(nn.unbox(params)).items()}


def param_shapes(model_config) -> dict[Path, tuple]:
  """{path: shape} of every parameter the model config builds, in the tree's order (traced abstractly)."""
  from sparsetx.models.transformer import Transformer  # noqa: PLC0415  (deferred: the model pulls in the kernels)

  frozen = ml_collections.FrozenConfigDict(model_config)
  abstract = jax.eval_shape(Transformer(frozen).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
  return tree_shapes(abstract["params"])

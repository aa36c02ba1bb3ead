"""What the export tests check of a sharded export beside an unsharded one."""

import json
import os

import jax
import numpy as np

from sparsetx.hf import custom, export


def assert_same_export(unsharded, sharded, shards: int):
  """The same files but the weights, and the same tensors in at least `shards` files named by the index."""
  index = json.loads((sharded / "model.safetensors.index.json").read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) >= shards and sorted(os.listdir(sharded)) == sorted(
    set(os.listdir(unsharded)) - {"model.safetensors"} | {*files, "model.safetensors.index.json"}
  )
  for name in os.listdir(unsharded):
    if name != "model.safetensors":
      assert (unsharded / name).read_bytes() == (sharded / name).read_bytes(), name
  whole, split = export.read_tensors(str(unsharded)), export.read_tensors(str(sharded))
  assert whole.keys() == split.keys() == index["weight_map"].keys()
  assert all(np.array_equal(whole[k].view(np.uint32), split[k].view(np.uint32)) for k in whole)


def random_params(model_config, seed: int = 0) -> dict:
  """A full flax param tree of random values (scales near 1, small biases, weights ~ 1/sqrt(d_model))."""
  rng = np.random.default_rng(seed)
  tensors = {}
  for name, shape in custom.expected_shapes(model_config).items():
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "scale":
      value = 1.0 + 0.1 * rng.standard_normal(shape)
    elif leaf in ("bias", "b_in", "b_out"):
      value = 0.1 * rng.standard_normal(shape)
    else:
      value = rng.standard_normal(shape) / np.sqrt(model_config.d_model)
    tensors[name] = value.astype(np.float32)
  params = {}
  for name, value in tensors.items():
    *parents, leaf = custom.flax_path(name)
    node = params
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value.astype(jax.numpy.dtype(model_config.param_dtype))
  return params

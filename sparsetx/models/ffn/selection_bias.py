"""Auxiliary-loss-free load balancing (Wang et al. 2024; DeepSeek-V3): a bias on the routing scores, for the choice.

A layer with config.model.ffn.bias_update_rate > 0 holds a float32 parameter `selection_bias` (one entry per unit:
MoE's experts; per channel and half, product keys' sub-keys), added to its scores before the top-k and nowhere else:
gates and outputs read the unbiased scores, so no gradient reaches it. The train step moves it outside the optimizer
by `update`, from the step's own unit counts; its rule is torchtitan's mean-centred form of the paper's sign update.
As a parameter it is checkpointed, resharded, evaluated, exported and imported with the model.
More: docs/modules.md, sparsetx/models/ffn/selection_bias.py.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from sparsetx import config as config_lib

NAME = "selection_bias"


def rate(ffn) -> float:
  """The layer's bias_update_rate (0.0 for a config saved before the field existed)."""
  return float(ffn.get("bias_update_rate", 0.0) or 0.0)


def param(module: nn.Module, shape: tuple) -> jax.Array:
  """The layer's bias: zeros at the start, float32 whatever param_dtype (a bf16 step of 0.001 would round away),
  replicated (a few values per unit). Declared as a variable of the params collection, whose zeros draw no key:
  the layer's other parameters are initialized as without it."""
  zeros = lambda: nn.LogicallyPartitioned(jnp.zeros(shape, jnp.float32), (None,) * len(shape))  # noqa: E731
  return module.variable("params", NAME, zeros).value


def update(bias, loads, rate: float):
  """bias + rate * (s - mean(s)), s = sign(mean(loads) - loads), means over the last axis (one group of units per
  leading index: an MoE layer's experts, a channel's half of sub-keys).

  The paper's sign update (b_i += u sign(mean load - load_i)) moves an underloaded unit up and an overloaded one down
  by u per step; torchtitan subtracts the step's mean move, which adds the same amount to every unit of a group and
  so leaves each top-k choice as the paper's rule makes it, while the biases keep a zero mean instead of drifting
  together (their float32 spacing stays fine however long the run)."""
  loads = loads.astype(jnp.float32)
  step = jnp.sign(loads.mean(-1, keepdims=True) - loads)
  return bias + rate * (step - step.mean(-1, keepdims=True))


def update_numpy(bias, loads, rate: float):
  """`update` in NumPy, for readers of saved counts."""
  loads = np.asarray(loads, np.float64)
  step = np.sign(loads.mean(-1, keepdims=True) - loads)
  return np.asarray(bias) + rate * (step - step.mean(-1, keepdims=True))


def split(params) -> tuple[dict, dict]:
  """(params without the biases, {flax path: bias}): what the step differentiates, and what it moves by hand."""
  flat = traverse_util.flatten_dict(params)
  biases = {path: leaf for path, leaf in flat.items() if path[-1] == NAME}
  if not biases:
    return params, {}
  rest = {path: leaf for path, leaf in flat.items() if path[-1] != NAME}
  return traverse_util.unflatten_dict(rest), biases


def merge(params, biases: dict):
  """`split`'s inverse: params with the biases put back at their paths."""
  if not biases:
    return params
  return traverse_util.unflatten_dict({**traverse_util.flatten_dict(params), **biases})


def moved(biases: dict, counts: dict, model_cfg, loads_of) -> dict:
  """{path: bias after the step} from the step's counts ({'layers_i': counts_U}); `loads_of(ffn, counts_U)` gives
  each layer's loads in its bias's shape (the layer type's FfnSpec.bias_loads)."""
  out = {}
  for path, bias in biases.items():
    layer = path[0]
    ffn = config_lib.layer_ffn_config(model_cfg, int(layer.removeprefix("layers_")))
    out[path] = update(bias, loads_of(ffn, counts[layer]).reshape(bias.shape), rate(ffn))
  return out

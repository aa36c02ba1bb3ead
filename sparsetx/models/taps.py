"""Named taps on the values inside a model: record them, and replace them on request.

`tap(module, name, value)` is placed wherever a model computes a value researchers read or
intervene on. It returns the patch from the `patches` variable collection when the caller passed one
for that module and name (a do-intervention), else the value itself, and sows what it returns
into `intermediates`, so a trace shows what the model actually used.
"""

import jax.numpy as jnp


def tap(module, name: str, value):
  if module.has_variable("patches", name):
    value = jnp.asarray(module.get_variable("patches", name)).astype(value.dtype).reshape(value.shape)
  module.sow("intermediates", name, value)
  return value

"""Named taps on the values inside a model: record them, and replace them on request.

`tap(module, name, value)` is placed wherever a model computes a value researchers read or
intervene on. It returns the patch from the `patches` variable collection when the caller passed one
for that module and name (a do-intervention), else the value itself, and sows what it returns
into `intermediates`, so a trace shows what the model actually used. An optional boolean
`patch_masks` entry of the same name (broadcastable to the value, e.g. [B,T,1,1] for chosen
positions) patches only where it is True: the rest of the value is computed as usual in the same
pass, which is what a position-wise do-intervention needs.
"""

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from sparsetx import scopes


def tap(module, name: str, value):
  if module.has_variable("patches", name):
    patch = jnp.asarray(module.get_variable("patches", name)).astype(value.dtype).reshape(value.shape)
    if module.has_variable("patch_masks", name):  # patch only where the mask (broadcast to value) is True
      patch = jnp.where(module.get_variable("patch_masks", name), patch, value)
    value = patch
  if name in scopes.SAVED_BY_NAME:  # what config.model.remat=save_routing keeps (models/transformer.py)
    value = checkpoint_name(value, name)
  module.sow("intermediates", name, value)
  return value

"""The logical rules in force: which mesh axes a logical axis name (batch, channel, embed, ...) maps to, set with
the mesh for a model's trace (`activate`), and the shapes and specs they give a table."""

import contextlib
import contextvars

import flax.linen as nn
import jax

from sparsetx.config import DEFAULT_RULES, rule_axes
from sparsetx.parallel import per_device

# Put first in config.mesh.rules, these split every `embed` axis over fsdp x expert and keep channels whole:
# neuron tables (PEER's shared one; sgatlin's when the expert axis is larger than its channel count)
# are then split by d_model over the expert axis, and the layers run the d-split gather (sparse_forms.py).
D_MODEL_SPLIT_RULES = (("embed", ("fsdp", "expert")), ("channel", None))


_RULES = contextvars.ContextVar("sparsetx_logical_rules", default=DEFAULT_RULES)


@contextlib.contextmanager
def activate(mesh, rules=DEFAULT_RULES):
  """Mesh and logical rules in the context, so sparse layers trace their expert-parallel form."""
  token = _RULES.set(tuple(tuple(rule) for rule in rules))
  try:
    with jax.set_mesh(mesh):
      yield
  finally:
    _RULES.reset(token)


def active_rules() -> tuple:
  """The logical rules in the context (`activate`)."""
  return _RULES.get()


def per_device_axes(mesh, rules) -> tuple:
  """The batch axes (size > 1): the train step runs its microbatch loop per device along all of them
  (parallel/microbatches.py), so every gradient is reduced over them once per step, after the loop. Inside it the sparse
  layers hold their tables' blocks along these axes (`block_shape`) and every other parameter whole."""
  return sized_axes(mesh, rule_axes(rules, "batch"))


def block_shape(shape, names, local, mesh, rules) -> tuple:
  """The shape of this device's block of a table with logical axes `names`, stored as the rules lay it out
  (`table_spec`): each dimension named in `local` (those the dispatcher runs on as blocks: units, d_model of a
  neuron table) divided by the already-manual mesh axes it is split over. `shape` itself outside the step's
  per-device loop (no manual axes)."""
  if per_device.no_mesh(mesh):
    return tuple(shape)
  manual = per_device.manual_axes(mesh)
  spec = table_spec(names, rules)
  return tuple(
    n // per_device.shards(mesh, [a for a in sized_axes(mesh, entry) if a in manual]) if name in local else n
    for n, name, entry in zip(shape, names, spec)
  )


def sized_axes(mesh, axes) -> tuple:
  """The mesh axes (a name, a tuple of names or None) of size > 1."""
  return tuple(a for a in per_device.axis_tuple(axes) if a in mesh.shape and mesh.shape[a] > 1)


def active_mesh_axes(mesh, logical_name: str) -> tuple:
  """The mesh axes of size > 1 that the active rules map `logical_name` to (e.g. 'batch', 'heads')."""
  return sized_axes(mesh, rule_axes(_RULES.get(), logical_name))


def table_spec(table_names, rules) -> tuple:
  """The mesh axes of each dimension of a table with these logical names (flax's assignment)."""
  spec = tuple(nn.logical_to_mesh_axes(table_names, tuple(tuple(rule) for rule in rules)))
  return spec + (None,) * (len(table_names) - len(spec))

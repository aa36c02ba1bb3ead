"""Whether a config's sparse layers split evenly over the mesh (each type's layout: FfnSpec.units, .neuron_table),
and which mesh axes split a layer's units (the windowed device load reads it: train/tracking/usage_window.py).

Checked before anything is compiled (training, evaluation, the ahead-of-time compile), so a bad mesh gets one
sentence naming the field instead of a sharding error deep inside XLA.
"""

from sparsetx import config as config_lib
from sparsetx.config.placements import EXPERT, placement_of
from sparsetx.models.ffn.registry import SPECS
from sparsetx.parallel import per_device
from sparsetx.parallel.logical_rules import D_MODEL_SPLIT_RULES, sized_axes, table_spec


def check_units_divide(config, mesh) -> None:
  """Refuses a sparse layer whose units don't split evenly over their mesh axes, naming the field.

  The axes are those the rules give the units in the layer's table (flax's assignment, as the
  parameter is stored), so rules that move the expert axis to the table's d_model are honoured.
  Both feed-forward sub-configs of a partly sparsified model are checked.
  """
  _check_layer_units(config, mesh, config.model.ffn, "config.model.ffn")
  if config_lib.is_mixed(config.model):
    _check_layer_units(config, mesh, config.model.dense_ffn, "config.model.dense_ffn")


def unit_axes(config, mesh, ffn) -> tuple:
  """The mesh axes (size > 1, major to minor) splitting a sparse layer's units into contiguous blocks, one per
  device along them, as its table is stored (expert_groups.unit_index numbers the blocks alike); () when its
  placement keeps the tables whole on every device or its type has no units (PEER's shared table). `config`'s
  placements resolved for the mesh (plan/step_cost.resolve_placements)."""
  spec = SPECS[ffn.type]
  if spec.units is None or placement_of(ffn).whole_on_device:
    return ()
  table_names = spec.units.table_axes
  return sized_axes(mesh, table_spec(table_names, config.mesh.rules)[table_names.index(spec.units.name)])


def _check_layer_units(config, mesh, ffn, prefix: str) -> None:
  spec = SPECS[ffn.type]
  placement = placement_of(ffn) if spec.sparse else EXPERT
  if placement.whole_on_device:  # d_model split over the axes its stored name gives (none: replicated)
    axes = sized_axes(mesh, config_lib.rule_axes(config.mesh.rules, placement.d_model_name))
    shards = per_device.shards(mesh, axes)
    if config.model.d_model % shards:
      others = ", ".join(repr(p) for p in config_lib.TABLE_PLACEMENTS if p not in ("auto", placement.name))
      raise config_lib.ConfigError(
        f"{prefix}.placement={placement.name!r} splits the tables' d_model={config.model.d_model} over the {shards} "
        f"devices of {' x '.join(f'{a}={mesh.shape[a]}' for a in axes)}, which do not divide it; use placement "
        f"{others}, or a d_model that is a multiple of {shards}."
      )
    return
  if spec.neuron_table is not None:
    names = spec.neuron_table
    axes = sized_axes(mesh, table_spec(names, config.mesh.rules)[-1])
    slices = per_device.shards(mesh, axes)
    if config.model.d_model % slices:
      raise config_lib.ConfigError(
        f"config.model.d_model={config.model.d_model} is not divisible by the {slices} devices the "
        f"{ffn.type} table's d_model is split over ({' x '.join(f'{a}={mesh.shape[a]}' for a in axes)}); "
        "change those mesh axes or the rules that give them to `embed`."
      )
  axes = unit_axes(config, mesh, ffn)
  if not axes:
    return
  field, shards = spec.units.field, per_device.shards(mesh, axes)
  if ffn[field] % shards:
    shape = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
    hint = ""
    if spec.neuron_table is not None and shards % ffn[field] == 0:  # too few units: split the table's d_model
      hint = (
        "; or split the table's d_model over those devices instead: put "
        f"{', '.join(map(str, D_MODEL_SPLIT_RULES))} first in config.mesh.rules"
      )
    raise config_lib.ConfigError(
      f"{prefix}.{field}={ffn[field]} is not divisible by the {shards} devices of the mesh axes it is "
      f"split over ({shape}); make it a multiple of {shards}, or move devices from those axes to data or fsdp{hint}."
    )

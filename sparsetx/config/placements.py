"""The table placements, one record each: where a sparse layer's tables live on a mesh and what that asks of its
computation. The config's choice list is theirs plus "auto"; what each costs and when it is refused is plan/'s
(plan/placement_plans.py); docs/expert_parallel.md, "Table placement", says why there are three."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Placement:
  """One table placement. `by_units`: the tables are split as the layer names them (units, and a neuron table's
  d_model, over their expert group: each device runs its own block and the tokens move); otherwise a table is
  whole where the kernels run, its d_model stored under the logical name `d_model_name` (the rules' `batch`
  axes: split over the devices holding other tokens and gathered whole for the layer, ZeRO-3's layout) or, None,
  replicated."""

  name: str
  by_units: bool
  d_model_name: str | None = None

  @property
  def whole_on_device(self) -> bool:
    """Whether the kernels see the whole table on each device (and each device's own tokens)."""
    return not self.by_units

  @property
  def gathered(self) -> bool:
    """Whether the table is split over the batch shards, all-gathered for the layer and its gradient
    reduce-scattered back."""
    return self.whole_on_device and self.d_model_name is not None

  def stored_names(self, names: tuple) -> tuple:
    """The logical axis names a table the layer names `names` is stored with."""
    if self.by_units:
      return tuple(names)
    return tuple(self.d_model_name if name == "embed" else None for name in names)

  def block_dims(self, local: tuple) -> tuple:
    """The dimensions (of `local`, the layer's units and a neuron table's d_model) a device takes as its block."""
    return tuple(local) if self.by_units else ()


EXPERT = Placement("expert", by_units=True)
FSDP = Placement("fsdp", by_units=False, d_model_name="batch")
DATA = Placement("data", by_units=False)
# Every placement by its config value, in "auto"'s tie-breaking order (plan/step_cost.choose_placement).
PLACEMENTS = {p.name: p for p in (EXPERT, FSDP, DATA)}


def placement_of(ffn) -> Placement:
  """The placement a layer with feed-forward sub-config `ffn` runs. "auto" is resolved for a mesh by
  plan/step_cost.resolve_placements (the trainer's setup does); unresolved (a model built without a mesh in
  view: evaluation, export) it runs expert, the layout the rules give."""
  name = ffn.get("placement", "auto")
  return EXPERT if name == "auto" else PLACEMENTS[name]

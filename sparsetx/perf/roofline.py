"""Projected step time of a compiled train step on a target chip, so a run is sized before it is rented.

More: docs/modules.md, sparsetx/perf/roofline.py.
"""

import dataclasses

from sparsetx import hardware


@dataclasses.dataclass(frozen=True)
class Projection:
  chip: hardware.Chip
  compute_s: float
  memory_s: float
  comm_s: float
  step_overlap_s: float
  step_serial_s: float
  tokens_per_s_overlap: float
  tokens_per_s_serial: float
  mfu_overlap: float
  mfu_serial: float


def link_bandwidth(chip: hardware.Chip, group: int) -> float:
  """Bytes/s one chip sends at in a ring over `group` chips: NVLink/ICI one way, or the DCN."""
  if chip.fast_domain is None:
    raise ValueError(f"the chip table has no interconnect figures for {chip.name}; collectives on it cannot be priced.")
  return chip.ici_bandwidth / 2 if group <= chip.fast_domain else chip.dcn_bandwidth


def dcn_bytes(op: str, nbytes: float, group: int, granules: int) -> float:
  """Bytes one chip sends over the DCN in a collective whose group spans `granules` nodes / slices, done
  hierarchically (inside each node first, then across the nodes on 1/local of the data, every chip on its own NIC;
  local = group / granules chips per node); `nbytes` is the result on one device:
    all-gather      S / local (k-1)/k        reduce-scatter  S (k-1)         all-reduce  2 S / local (k-1)/k
    all-to-all      S (k-1)/k                collective-permute  S           (k = granules)"""
  if granules <= 1:
    return 0.0
  k, local = granules, max(group // granules, 1)
  share = (k - 1) / k
  return {
    "all-gather": nbytes / local * share,
    "reduce-scatter": nbytes * (k - 1),
    "all-reduce": 2 * nbytes / local * share,
    "all-to-all": nbytes * share,
    "ragged-all-to-all": nbytes * share,
    "collective-permute": nbytes,
  }[op]


def collective_seconds(op: str, nbytes: float, group: int, chip: hardware.Chip, granules: int = 1) -> float:
  """Ring-algorithm time of one collective whose result holds `nbytes` on each device; a group spanning
  `granules` > 1 nodes / slices: the part inside a node at NVLink/ICI rate plus dcn_bytes at the DCN rate."""
  if granules > 1:
    return collective_seconds(op, nbytes, group // granules, chip) + dcn_bytes(op, nbytes, group, granules) / (
      chip.dcn_bandwidth
    )
  if group <= 1:
    return 0.0
  return ring_bytes(op, nbytes, group) / link_bandwidth(chip, group)


def ring_bytes(op: str, nbytes: float, group: int) -> float:
  """Bytes one device sends in a ring collective of `group` devices whose result holds `nbytes` on each: (g-1)/g
  of it for an all-gather or all-to-all, g-1 times it for a reduce-scatter (the result is the device's shard),
  twice (g-1)/g for an all-reduce, all of it for a collective-permute. A ragged all-to-all (MoE's rows) is priced
  as an all-to-all of its result buffer, which is sized for the worst routing: an upper bound of what it sends."""
  share = (group - 1) / group
  factors = {
    "all-gather": share,
    "reduce-scatter": group - 1,
    "all-reduce": 2 * share,
    "all-to-all": share,
    "ragged-all-to-all": share,
  }
  if op == "collective-permute":
    return nbytes
  if op not in factors:
    raise ValueError(f"unknown collective {op!r}")
  return factors[op] * nbytes


def project(report, chip: hardware.Chip) -> Projection:
  """The roofline of `report` (an aot.Report) on `chip`."""
  compute = report.compiled_flops / chip.peak_flops
  memory = report.bytes_accessed / chip.hbm_bandwidth
  comm = sum(collective_seconds(c.op, c.nbytes, c.group, chip, _granules(c)) for c in report.collectives)
  overlap = max(compute, memory, comm)
  serial = max(compute, memory) + comm
  devices = 1
  for size in report.mesh_shape.values():
    devices *= size

  def rates(step):
    if step <= 0:
      return 0.0, 0.0
    return report.tokens_per_step / step, report.model_flops / (step * devices * chip.peak_flops)

  (tps_overlap, mfu_overlap), (tps_serial, mfu_serial) = rates(overlap), rates(serial)
  return Projection(chip, compute, memory, comm, overlap, serial, tps_overlap, tps_serial, mfu_overlap, mfu_serial)


def _granules(collective) -> int:
  return getattr(collective, "granules", 1)


FFN_SCOPE = "/mlp/"  # the feed-forward layers' op_name scope (the block's `mlp` submodule)


def outside_ffn(collectives) -> list:
  """The compiled collectives that are not the feed-forward layers' (their op_name lacks FFN_SCOPE)."""
  return [c for c in collectives if FFN_SCOPE not in c.source]


def project_analytic(
  chip: hardware.Chip, parts, tokens_per_step: int, model_flops: float, devices: int, rest_collectives=()
) -> Projection:
  """The step as analytic parts: `parts` = [(times per step, layer_cost.LayerCost)] (each feed-forward layer and
  the remainder), `rest_collectives` the compiled collectives outside the feed-forward layers (hlo_text.Collective).

  compute / memory are the parts' total FLOPs / peak and bytes / bandwidth; the step is the sum over phases of the
  slower of the two (overlap: max of that and the communication; serial: their sum).
  """
  compute = memory = phases = comm = 0.0
  for count, cost in parts:
    for p in cost.phases:
      compute += count * p.flops / chip.peak_flops
      memory += count * p.nbytes / chip.hbm_bandwidth
      phases += count * max(p.flops / chip.peak_flops, p.nbytes / chip.hbm_bandwidth)
    comm += count * sum(collective_seconds(c.op, c.nbytes, c.group, chip) for c in cost.collectives)
  comm += sum(collective_seconds(c.op, c.nbytes, c.group, chip, _granules(c)) for c in rest_collectives)
  overlap, serial = max(phases, comm), phases + comm

  def rates(step):
    return tokens_per_step / step, model_flops / (step * devices * chip.peak_flops)

  (tps_overlap, mfu_overlap), (tps_serial, mfu_serial) = rates(overlap), rates(serial)
  return Projection(chip, compute, memory, comm, overlap, serial, tps_overlap, tps_serial, mfu_overlap, mfu_serial)


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.3g}"


COMPILED_TITLE = (
  "projected step time (roofline per device at peak rates from the compiled program's counts;"
  " sparsetx/perf/roofline.py)\n  overlapped: step = max(compute, memory, comm); serial: step = max(compute, memory) + comm"
)
ANALYTIC_TITLE = (
  "projected step time, analytic (feed-forward layers and the rest of the step by sparsetx/plan/layer_cost.py,"
  " collectives outside the feed-forward layers from the compiled program; roofline.project_analytic)\n"
  "  overlapped: step = max(sum of phase times, comm); serial: step = sum of phase times + comm;"
  " phase time = max(FLOPs / peak, bytes / bandwidth)"
)
LOWERED_ONLY = "collectives outside the feed-forward layers from the compiled program"
LOWERED_ONLY_NOTE = "no compiled program (lowered only): collectives outside the feed-forward layers not counted"


def format_projections(projections: list[Projection], title: str = COMPILED_TITLE) -> str:
  """The table sparsetx/tools/dry_run.py prints: one row per chip, times in ms, with and without overlap."""
  lines = [
    *title.split("\n"),
    f"  {'target':<10}{'compute ms':>11}{'memory ms':>11}{'comm ms':>10}"
    f"{'overlap ms':>12}{'tokens/s':>12}{'MFU':>7}{'serial ms':>11}{'tokens/s':>12}{'MFU':>7}",
  ]
  for p in projections:
    lines.append(
      f"  {p.chip.name:<10}{_ms(p.compute_s):>11}{_ms(p.memory_s):>11}{_ms(p.comm_s):>10}"
      f"{_ms(p.step_overlap_s):>12}{p.tokens_per_s_overlap:>12,.0f}{p.mfu_overlap:>7.1%}"
      f"{_ms(p.step_serial_s):>11}{p.tokens_per_s_serial:>12,.0f}{p.mfu_serial:>7.1%}"
    )
  return "\n".join(lines)

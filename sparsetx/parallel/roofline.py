"""Projected step time of a compiled train step on a target chip, so a run is sized before it is rented.

A roofline from sparsetx/train/aot.py's Report (one device's compiled program) and
sparsetx/parallel/hardware.py's published figures, per device:
  compute  = compiled FLOPs / peak bf16 FLOP/s
  memory   = compiled "bytes accessed" / HBM bandwidth
  comm     = sum over the program's collectives of ring-algorithm time at the group's link rate
             (half the bidirectional NVLink/ICI figure inside a node or slice, DCN beyond):
               all-gather      S (g-1)/g / bw     S = the gathered result
               reduce-scatter  S (g-1)/g / bw     S = the unreduced input = g x the result
               all-reduce      2 S (g-1)/g / bw   (a reduce-scatter, then an all-gather)
               all-to-all      S (g-1)/g / bw     (each device keeps 1/g of its buffer)
               collective-permute  S / bw
  step with overlap    = max(compute, memory, comm)
  step without overlap = max(compute, memory) + comm
tokens/s = tokens per step / step; MFU = the model's FLOPs per step (ladder accounting) / (step x
devices x peak). A lower bound on step time: it assumes peak rates, and XLA prints a loop body
(micro-batch scan, layer scan) once, so work inside loops is counted once.
"""

import dataclasses

from sparsetx.parallel import hardware


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
  return chip.ici_bandwidth / 2 if group <= chip.fast_domain else chip.dcn_bandwidth


def collective_seconds(op: str, nbytes: float, group: int, chip: hardware.Chip) -> float:
  """Ring-algorithm time of one collective whose result holds `nbytes` on each device."""
  if group <= 1:
    return 0.0
  bw = link_bandwidth(chip, group)
  share = (group - 1) / group
  if op == "all-gather":
    return nbytes * share / bw
  if op == "reduce-scatter":
    return nbytes * group * share / bw
  if op == "all-reduce":
    return 2 * nbytes * share / bw
  if op == "all-to-all":
    return nbytes * share / bw
  if op == "collective-permute":
    return nbytes / bw
  raise ValueError(f"unknown collective {op!r}")


def project(report, chip: hardware.Chip) -> Projection:
  """The roofline of `report` (an aot.Report) on `chip`."""
  compute = report.compiled_flops / chip.peak_flops
  memory = report.bytes_accessed / chip.hbm_bandwidth
  comm = sum(collective_seconds(c.op, c.nbytes, c.group, chip) for c in report.collectives)
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


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.3g}"


def format_projections(projections: list[Projection]) -> str:
  """The table sparsetx/tools/dry_run.py prints: one row per chip, times in ms, with and without overlap."""
  lines = [
    "projected step time (roofline per device at peak rates from the compiled program's counts;"
    " sparsetx/parallel/roofline.py)",
    "  overlapped: step = max(compute, memory, comm); serial: step = max(compute, memory) + comm",
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

"""The vocabulary of the analytic step cost: phases (HBM bytes and FLOPs), collectives, and a builder that applies
the remat policy's run counts and the table placement. Each feed-forward type states its cost in these terms
(FfnSpec.cost); sparsetx.plan adds them up per step and docs/cost_model.md derives the bytes."""

import dataclasses

from sparsetx import hardware
from sparsetx.config.placements import EXPERT, Placement
from sparsetx.perf import roofline

F32 = 4  # bytes of float32 parameters, gradients, optimizer moments, scores and dots
INDEX = 4  # bytes of an int32 row id, token id or sort key
RADIX_PASSES = 4  # passes of the table gradients' radix sort of (row, pair) keys (8-bit digits of a 32-bit key)
RADIX_BYTES_PER_PAIR = 8  # an int32 key and an int32 pair id, read and written by every pass
ADAMW_READS, ADAMW_WRITES = 4, 3  # float32 values per element: param, grad, two moments in; param, moments out
ADAMW_FLOPS = 12  # per element: two moment updates, bias corrections, sqrt, divide, weight decay, step
TOP_K_OPS_PER_SCORE = 1  # comparisons per score a top-k reads (a lower bound on the selection work)


@dataclasses.dataclass(frozen=True)
class Phase:
  name: str
  nbytes: float  # HBM bytes per step, all runs
  flops: float  # per step, all runs
  runs: int = 1  # 2 for forward work that remat recomputes


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
  op: str  # a roofline.collective_seconds op
  nbytes: float  # the result's bytes on one device, per step (all runs)
  group: int
  what: str
  runs: int = 1
  placed: bool = False  # moved because of where the layer's tables are (what the table placements are compared by)

  @property
  def sent(self) -> float:
    """Bytes one device sends per step, by the ring algorithm roofline.collective_seconds times."""
    return roofline.ring_bytes(self.op, self.nbytes, self.group)


@dataclasses.dataclass(frozen=True)
class LayerCost:
  name: str  # the ffn type, or "rest" for the step's remainder
  tokens: int  # own tokens per device
  phases: tuple
  collectives: tuple
  table_bytes: float = 0.0  # the layer's tables (weights) on the device in the compute dtype, as the kernels read them

  @property
  def nbytes(self) -> float:
    return sum(p.nbytes for p in self.phases)

  @property
  def flops(self) -> float:
    return sum(p.flops for p in self.phases)


@dataclasses.dataclass(frozen=True)
class LayerTime:
  chip: hardware.Chip
  phase_s: tuple  # per phase, max(flops / peak, bytes / bandwidth)
  hbm_bound: tuple  # per phase, whether bytes / bandwidth > flops / peak
  comm_s: float

  @property
  def compute_s(self) -> float:
    return sum(self.phase_s)

  @property
  def total_s(self) -> float:
    return self.compute_s + self.comm_s

  @property
  def hbm_share(self) -> float:
    """The share of the layer's time spent in HBM-bound phases."""
    total = self.total_s
    return sum(t for t, bound in zip(self.phase_s, self.hbm_bound) if bound) / total if total > 0 else 0.0


def time_on(cost: LayerCost, chip: hardware.Chip) -> LayerTime:
  """Each phase at the chip's peak rate or HBM bandwidth, whichever is slower, and the collectives' ring time."""
  memory = [p.nbytes / chip.hbm_bandwidth for p in cost.phases]
  compute = [p.flops / chip.peak_flops for p in cost.phases]
  comm = sum(roofline.collective_seconds(c.op, c.nbytes, c.group, chip) for c in cost.collectives)
  return LayerTime(chip, tuple(map(max, memory, compute)), tuple(m > c for m, c in zip(memory, compute)), comm)


class CostBuilder:
  """Collects phases and collectives, applying the remat policy's run counts and the table placement."""

  def __init__(self, remat: str, placement: Placement = EXPERT, microbatches: int = 1, shards: int = 1):
    self.remat = remat
    self.placement, self.microbatches, self.shards = placement, microbatches, shards
    self.phases, self.collectives = [], []
    self.table_bytes = 0.0

  def forward_runs(self, dot: bool) -> int:
    if self.remat == "none":
      return 1
    return 2 if self.remat == "full" or not dot else 1

  def add(self, name, nbytes, flops, forward=False, dot=False):
    runs = self.forward_runs(dot) if forward else 1
    if nbytes or flops:
      self.phases.append(Phase(name, runs * nbytes, runs * flops, runs))

  def matmul(self, name, m, k, n, a_bytes, w_bytes, out_bytes, backward=True, forward_runs=True):
    """Forward matmul [m, k] x [k, n] and, with `backward`, its two backward matmuls (dw in float32)."""
    self.add(name, m * k * a_bytes + k * n * w_bytes + m * n * out_bytes, 2 * m * k * n, forward=forward_runs, dot=True)
    if backward:
      dx = m * n * out_bytes + k * n * w_bytes + m * k * a_bytes
      dw = m * k * a_bytes + m * n * out_bytes + k * n * F32
      self.add(f"{name} backward", dx + dw, 4 * m * k * n)

  def collective(self, op, nbytes, group, what, forward=False, placed=False):
    if group <= 1 or nbytes <= 0:
      return
    runs = self.forward_runs(False) if forward else 1
    self.collectives.append(CollectiveCost(op, runs * nbytes, group, what, runs, placed))

  def cast(self, elements, b):
    """The float32 parameters cast to a narrower compute dtype once per step."""
    if b < F32:
      self.add("cast tables to compute dtype", elements * (F32 + b), 0)

  def optimizer(self, elements):
    self.add("optimizer (AdamW)", elements * F32 * (ADAMW_READS + ADAMW_WRITES), elements * ADAMW_FLOPS)

  def grad_sync(self, elements, replicas, placed=False, what="gradients over replicas"):
    """Gradient all-reduce over the devices holding the same shard of these parameters (data parallelism)."""
    self.collective("all-reduce", elements * F32, replicas, what, placed=placed)

  def fsdp(self, elements, group, what, placed=False):
    """Parameters split over `group` devices, gathered whole for the layer (float32, as stored: the kernels read
    and cast them) and their gradient reduce-scattered back. With micro-batches the gather runs once, before the
    step's per-device loop; without, inside the layer, again in the backward under remat."""
    self.collective("all-gather", elements * F32, group, what, forward=self.microbatches == 1, placed=placed)
    self.collective("reduce-scatter", elements * F32 / group, group, f"{what}: gradients", placed=placed)

  def tables(self, elements, replicas):
    """A layer's tables of `elements` on the device, synced as placed: gathered over the batch shards and
    reduce-scattered (a placement that gathers them: fsdp), else all-reduced over their replicas. Returns the
    elements the optimizer updates on the device."""
    if self.placement.gathered:
      self.fsdp(elements, self.shards, f"tables gathered whole ({self.placement.name} placement)", placed=True)
      return elements / self.shards
    self.grad_sync(elements, replicas, placed=True, what="table gradients over replicas")
    return elements

  def cost(self, name, tokens) -> LayerCost:
    return LayerCost(name, tokens, tuple(self.phases), tuple(self.collectives), self.table_bytes)


def gather_kernels(bld: CostBuilder, N, S, d, b, R, with_bias=False, forward_dots=True, segment_chunk=0):
  """The gated gather's kernels on N tokens x S rows of d values, and its table gradients over R rows (rows of more
  than `segment_chunk` pairs cut and combined: kernel.segment_chunk)."""
  pairs = N * S
  if forward_dots:
    bld.add("gather fwd row_dots", pairs * d * b + N * d * b + pairs * INDEX + pairs * F32, 2 * pairs * d, forward=True)
  bld.add(
    "gather fwd row_accumulate",
    pairs * d * b + pairs * INDEX + 2 * pairs * F32 + N * d * b,
    2 * pairs * d,
    forward=True,
  )
  bld.add(
    "gather bwd row_dots (dy.w_out)",
    pairs * d * b + N * d * b + pairs * INDEX + 2 * pairs * F32 + 3 * pairs * F32,
    2 * pairs * d,
  )
  bld.add("gather bwd row_accumulate (dx)", pairs * d * b + pairs * INDEX + pairs * F32 + N * d * b, 2 * pairs * d)
  bld.add("table grads: sort (row, pair) keys", RADIX_PASSES * pairs * RADIX_BYTES_PER_PAIR * 2, 0)
  bld.add(
    "table grads: segment sums",
    2 * pairs * d * b + 3 * pairs * INDEX + 2 * R * d * F32 + (R * F32 if with_bias else 0),
    2 * 2 * pairs * d,
  )
  tails = pairs // segment_chunk if segment_chunk else 0
  if tails:  # kernels/rows/row_chunks.py: tail segments written, each long row's partials read and its sum written back
    long_rows = min(R, tails)
    combined = (long_rows + tails) * (d * F32 + INDEX + F32)
    permuted = pairs * 2 * (INDEX + F32)  # the pairs' tokens and coefficients gathered into head/tail order
    bld.add("table grads: cut rows combined", 2 * (tails * d * F32 + combined + 2 * long_rows * d * F32 + permuted), 0)

"""Analytic cost of one feed-forward layer per train step on one device: HBM bytes, FLOPs and collectives by phase.

Why: the dry run's roofline (roofline.py) reads the CPU-compiled program, which counts a loop body once and shapes
the sparse layers for a CPU's caches, so it cannot say where their time goes on a GPU or TPU. This model counts
what the accelerator kernels move and compute, from the config's shapes alone, phase by phase, and times each
phase on a chip (hardware.py) as max(FLOPs / peak, bytes / HBM bandwidth), the collectives as
roofline.collective_seconds. A phase is HBM-bound when its bytes take longer than its FLOPs.

Notation (per device and train step): n own tokens, E the expert group (the mesh axes splitting the layer's units,
which also split the batch under the default rules), G the d-group (the axes splitting a neuron table's d_model:
sgatlin / PEER's d-split gather; for the other types the FSDP split of their weights; both groups are taken to split
the batch too, as the default rules' expert and fsdp axes do), b bytes of the compute
dtype, 4 of float32 (parameters, gradients, scores, dots). A gather kernel sees N = n E G tokens (the group's,
gathered) with S rows each, of D / G values: N S D / G = n E S D values per table, whatever G.

Kernels, as the accelerator paths run them (sparsetx/kernels), on N S rows of D/G values in dtype b with int32 ids:
  forward   row_dots (h = <w_in, x>)       reads the rows, x (N x D/G, b), the ids; writes h (float32 per pair)
            row_accumulate (y)             reads the rows, the ids, h and the gates; writes y (N x D/G, b)
  backward  row_dots (dy . w_out)          reads the rows, dy, the ids, h and the gates; writes dgate, coef_in, coef_out
            row_accumulate (dx from w_in)  reads the rows, the ids, coef_in; writes dx
  table gradients: a sort of the N S (row, pair) int32 keys (a radix sort: RADIX_PASSES passes, each reading and
  writing RADIX_BYTES_PER_PAIR per pair) and segment sums (x and dy rows in b, per pair its token id and two
  coefficients; two float32 tables R x D/G written, R = the table rows on the device).
  A run whose compute dtype is narrower than float32 first casts each table once per step (reads 4, writes b per
  element). The optimizer (AdamW, float32) reads param, grad and two moments and writes three per element.
A matmul [m, k] x [k, n] moves m k + k n inputs and m n outputs; its backward is two matmuls (dx: dy w^T,
dw: x^T dy, dw in float32). Routers run in float32 on the own tokens; top-k is counted as TOP_K_OPS_PER_SCORE
operations per score read. remat="full" recomputes the whole forward (phases marked x2); the dots policies save
matmul outputs, so only the non-matmul forward phases (kernels, top-k, sorts) and the collectives run twice.
MoE assumes balanced routing (n k pairs per device on average, sent by ragged all-to-all; the dropless receive
buffer holds all N k pairs of the group, which the receive sort and permutation touch).

Table placements (dispatch.py): expert as above; fsdp and data run the kernels on the own tokens with whole tables
(E = G = 1), fsdp gathering them over the batch shards and reduce-scattering their gradients, data all-reducing
them. Micro-batches: the kernels and the tokens' collectives are one pass of the batch; every gradient reduction
runs once per step (the step's micro-batch loop runs per device along every batch axis, train/step.py), and with
micro-batches a parameter gathered whole (FSDP) is gathered once, before the loop, so remat does not gather it
again. `step_cost.placement_options` compares the placements by the bytes each device sends (docs/expert_parallel.md,
"Table placement").

Not modeled: the tensor axis (assumed 1), norms, biases of dense layers,
kernel tiling overheads and latencies (peak rates: a lower bound, like roofline.py), caches: every picked row is
read from HBM, though a device's table slice can fit in a GPU's L2 at small scales (docs/kernels.md).

`remainder_cost` models the rest of the step the same way (attention, head, embedding, their optimizer), so
roofline.project_analytic can project a whole step without the CPU-compiled program's counts.

`sparsetx-layer-cost` (sparsetx/tools/layer_cost.py) prints docs/kernels.md's table (ladder scales 2, 5, 8;
32,768 tokens per device, expert group 8).
"""

import dataclasses
import functools
import math

import jax.numpy as jnp

from sparsetx import config as config_lib
from sparsetx.models.ffn.registry import SPECS
from sparsetx.parallel import expert_parallel, hardware, roofline

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
class Collective:
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


class _Builder:
  """Collects phases and collectives, applying the remat policy's run counts and the table placement."""

  def __init__(self, remat: str, placement: str = "expert", microbatches: int = 1, shards: int = 1):
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
    self.collectives.append(Collective(op, runs * nbytes, group, what, runs, placed))

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
    """A layer's tables of `elements` on the device, synced as placed: all-reduced over their replicas (expert,
    data), or gathered over the batch shards and reduce-scattered (fsdp). Returns the elements the optimizer
    updates on the device."""
    if self.placement == "fsdp":
      self.fsdp(elements, self.shards, "tables gathered whole (fsdp placement)", placed=True)
      return elements / self.shards
    self.grad_sync(elements, replicas, placed=True, what="table gradients over replicas")
    return elements

  def cost(self, name, tokens) -> LayerCost:
    return LayerCost(name, tokens, tuple(self.phases), tuple(self.collectives), self.table_bytes)


def _gather(bld: _Builder, N, S, d, b, R, with_bias=False, forward_dots=True):
  """The gated gather's kernels on N tokens x S rows of d values, and its table gradients over R rows."""
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


def _candidate_pairs(k: int) -> int:
  """Stage two's candidates: ranks (i, j) of the halves' top-k with (i + 1)(j + 1) <= k (product_keys.py)."""
  return sum(1 for i in range(k) for j in range(k) if (i + 1) * (j + 1) <= k)


def _product_key_router(bld: _Builder, n, D, C, n_keys, k, d_key, b, peer: bool):
  """The router on the own tokens, float32: query, both halves' scores, the two top-k stages, their backward."""
  if peer:  # a query per channel, halves of d_key / 2 scored against per-channel sub-keys
    bld.matmul("router query", n, D, C * d_key, b, F32, F32, forward_runs=True)
    bld.add(
      "router sub-key scores",
      C * (n * d_key * F32 + 2 * n_keys * (d_key // 2) * F32 + n * 2 * n_keys * F32),
      2 * n * C * 2 * n_keys * (d_key // 2),
      forward=True,
      dot=True,
    )
    bld.add(
      "router sub-key scores backward",
      2 * C * (n * d_key * F32 + 2 * n_keys * (d_key // 2) * F32 + n * 2 * n_keys * F32),
      4 * n * C * 2 * n_keys * (d_key // 2),
    )
  else:  # one shared query, 2 key halves per channel
    bld.matmul("router query", n, D, d_key, b, F32, F32)
    bld.matmul("router key scores", n, d_key, 2 * C * n_keys, F32, F32, F32)
  scores = n * 2 * C * n_keys
  bld.add(
    "router top-k stage 1", scores * F32 + n * 2 * C * k * (F32 + INDEX), scores * TOP_K_OPS_PER_SCORE, forward=True
  )
  candidates = _candidate_pairs(k)
  bld.add(
    "router top-k stage 2",
    n * C * 2 * k * (F32 + INDEX) + n * C * k * (F32 + INDEX),
    n * C * candidates * (1 + k),
    forward=True,
  )
  bld.add("router scores backward (scatter into halves)", scores * F32 + n * C * k * (F32 + INDEX), 0)


def _neuron_table(bld, model, ffn, n, E, G, b, devices):
  """sgatlin and PEER: product-key router, gated gather over the device's rows, the expert-parallel collectives."""
  D, C, k, F = model.d_model, ffn.n_channels, ffn.top_k, ffn.d_ffw
  peer = ffn.type == "peer" or ffn.get("router", "product") == "peer"
  n_keys = math.isqrt(F)
  _product_key_router(bld, n, D, C, n_keys, k, ffn.d_key, b, peer)
  shared = ffn.type == "peer"
  c = 1 if shared else C // E  # tables on this device (PEER's is shared by the channels)
  R, d = c * F, D // G
  N, S = n * E * G, (C // E) * k
  bld.cast(2 * R * d, b)
  bld.table_bytes = 2 * R * d * b
  _gather(bld, N, S, d, b, R)
  if peer:  # per-channel queries and sub-keys, split with the channels
    replicated, split = 0, (C * D * ffn.d_key + C * n_keys * ffn.d_key) // E
  else:  # the shared query everywhere, the keys split with the channels
    replicated, split = D * ffn.d_key, ffn.d_key * 2 * C * n_keys // E
  bld.optimizer(bld.tables(2 * R * d, devices // (E * G)) + replicated + split)
  bld.grad_sync(replicated, devices)
  bld.grad_sync(split, devices // E)
  # Unit split (docs/expert_parallel.md): tokens all-gathered, indices and gates to the owners, y reduce-scattered.
  tokens = functools.partial(bld.collective, placed=True)
  tokens("all-gather", n * E * D * b, E, "x to the expert group", forward=True)
  tokens("all-to-all", n * C * k * (INDEX + F32), E, "indices and gates to owners", forward=True)
  tokens("reduce-scatter", n * D * F32, E, "y partial sums (float32)", forward=True)
  if G == 1:  # y cast to b by the reduce-scatter (ep.scatter_back): its dy holds b values and moves in b
    tokens("all-gather", n * E * D * b, E, "dy to the expert group")
  else:
    tokens("all-gather", n * E * D * F32, E, "dy to the expert group (float32)")
  tokens("reduce-scatter", n * D * F32, E, "dx partial sums (float32)")
  tokens("all-to-all", n * C * k * F32, E, "gate gradients back")
  # d-split (G > 1): x by d-slice, indices and gates all-gathered, partial dots all-reduced, y back.
  y_bytes = b if shared else F32
  tokens("all-to-all", n * E * D * b, G, "x d-slices to the d-group", forward=True)
  tokens("all-gather", G * n * C * k * (INDEX + F32), G, "indices and gates over the d-group", forward=True)
  tokens("all-reduce", G * n * C * k * F32, G, "partial dots", forward=True)
  tokens("all-to-all", n * E * D * y_bytes, G, "y d-slices back", forward=True)
  tokens("all-to-all", n * E * D * b, G, "dy d-slices")
  tokens("all-reduce", G * n * C * k * F32, G, "partial dot gradients")
  tokens("all-to-all", n * E * D * y_bytes, G, "dx d-slices back")
  tokens("reduce-scatter", n * C * k * F32, G, "gate gradients")


def _fff(bld, model, ffn, n, E, G, b, devices):
  """FFF: top DENSE_LEVELS levels as matmuls against their 7 nodes per tree, one row_dots per deeper level, the
  deeper levels' outputs through row_accumulate, the tree walk's gradients as the gated gather's."""
  from sparsetx.kernels.tree_route import DENSE_LEVELS  # the walk's constant (kernels are read, never edited here)

  D, P, L = model.d_model, ffn.n_trees // E, ffn.depth + 1
  Z = 2 ** (ffn.depth + 1) - 1
  top = min(DENSE_LEVELS, L)
  n_top, deep = 2**top - 1, L - top
  N, R = n * E, P * Z
  bld.cast(2 * R * D, b)
  bld.table_bytes = 2 * R * D * b
  bld.fsdp(R * 2 * D, G, "tables over fsdp (FSDP)", placed=True)
  if top:
    bld.matmul("top levels: logits (dense)", N, D, P * n_top, b, b, F32)
    bld.matmul("top levels: outputs (dense)", N, P * n_top, D, b, b, F32)
  if deep:
    level = N * P * D * b + N * D * b + 2 * N * P * INDEX + 2 * N * P * F32  # rows, x, node ids, b_in, z, next ids
    bld.add(f"walk: {deep} x row_dots (S={P})", deep * level, deep * 2 * N * P * D, forward=True)
    _gather(bld, N, P * deep, D, b, R, with_bias=True, forward_dots=False)
  tables = bld.tables((R * 2 * D) / G, devices // (E * G))
  bld.optimizer(tables + R + D)
  bld.grad_sync(R + D, devices // (E * G))  # b_in, b_out
  tokens = functools.partial(bld.collective, placed=True)
  tokens("all-gather", N * D * b, E, "x to the expert group", forward=True)
  tokens("reduce-scatter", n * D * F32, E, "y partial sums (float32)", forward=True)
  tokens("all-to-all", n * ffn.n_trees * L * (INDEX + F32), E, "path nodes and logits back", forward=True)
  tokens("all-gather", N * D * F32, E, "dy to the expert group (float32)")
  tokens("reduce-scatter", n * D * F32, E, "dx partial sums (float32)")


def _moe(bld, model, ffn, n, E, G, b, devices):
  """MoE (moe.py): float32 router, top-k, dropless sort of all the group's pairs, SwiGLU experts by grouped matmuls
  over the pairs routed to this device's experts (n k on average), the permutation back and the weighted sum."""
  D, F, X, A = model.d_model, ffn.d_ffw, ffn.n_experts, ffn.experts_per_token
  x_local, N = X // E, n * E
  pairs_all, pairs = N * A, n * A
  weights = 3 * x_local * D * F
  bld.matmul("router", n, D, X, b, F32, F32)
  bld.add("router top-k", n * X * F32 + n * A * (F32 + INDEX), n * X * TOP_K_OPS_PER_SCORE, forward=True)
  bld.cast(weights, b)
  bld.table_bytes = weights * b
  bld.fsdp(weights, G, "expert weights over fsdp (FSDP)", placed=True)
  bld.add("dispatch: sort the group's pairs", RADIX_PASSES * pairs_all * RADIX_BYTES_PER_PAIR * 2, 0, forward=True)
  bld.add("dispatch: gather x rows of every pair", 2 * pairs_all * D * b, 0, forward=True)
  bld.matmul("experts: gate and up (grouped)", pairs, D, 2 * F, b, b, F32)  # the two [D, F] weights side by side
  bld.add("experts: swish(gate) * up", 2 * pairs * F * F32 + pairs * F * b, 4 * pairs * F, forward=True)
  bld.add("experts: swish(gate) * up backward", 2 * pairs * F * F32 + pairs * F * b + 2 * pairs * F * b, 8 * pairs * F)
  bld.matmul("experts: down (grouped)", pairs, F, D, b, b, F32)
  bld.add(
    "combine: unpermute and weight",
    2 * pairs_all * D * F32 + pairs_all * D * F32 + pairs_all * F32 + N * D * b,
    2 * pairs_all * D,
    forward=True,
  )
  bld.add("combine backward", N * D * b + pairs_all * F32 + 3 * pairs_all * D * F32, 2 * pairs_all * D)
  bld.add("dispatch backward: scatter-add dx rows", pairs_all * D * b + N * D * b, pairs_all * D)
  router = D * X + X
  bld.optimizer(bld.tables(weights / G, devices // (E * G)) + router)
  bld.grad_sync(router, devices)
  # dispatch.all_to_all_experts: ragged all-to-alls of the n k pairs' rows, in the compute dtype, each way
  tokens = functools.partial(bld.collective, placed=True)
  tokens("all-gather", E * X * INDEX, E, "per-expert pair counts (sizes and offsets)", forward=True)
  tokens("all-to-all", pairs * D * b, E, "x rows to their experts' devices (ragged)", forward=True)
  tokens("all-to-all", pairs * D * b, E, "expert outputs back (ragged)", forward=True)
  tokens("all-to-all", pairs * D * b, E, "dy rows to the experts (ragged)")
  tokens("all-to-all", pairs * D * b, E, "dx rows back (ragged)")


def _dense(bld, model, ffn, n, E, G, b, devices):
  """MLP (GELU) and SwiGLU: matmuls on the own tokens, weights FSDP-gathered over G."""
  D, F = model.d_model, ffn.d_ffw
  ins = 2 if ffn.type == "swiglu" else 1
  weights = (ins + 1) * D * F
  bld.cast(weights, b)
  bld.table_bytes = weights * b
  bld.fsdp(weights, G, "weights over fsdp (FSDP)")
  bld.matmul("in projection" + ("s (gate, up)" if ins == 2 else ""), n, D, ins * F, b, b, b)
  bld.add("activation", (ins + 1) * n * F * b, 4 * n * F, forward=True)
  bld.add("activation backward", (2 * ins + 1) * n * F * b, 8 * n * F)
  bld.matmul("out projection", n, F, D, b, b, b)
  bld.optimizer(weights / G)
  bld.grad_sync(weights / G, devices // G)


_LAYERS = {"sgatlin": _neuron_table, "peer": _neuron_table, "fff": _fff, "moe": _moe, "mlp": _dense, "swiglu": _dense}


def layer_cost(
  model,
  ffn,
  tokens: int,
  expert_group: int = 1,
  d_group: int = 1,
  devices: int | None = None,
  placement: str = "expert",
  microbatches: int = 1,
):
  """The LayerCost of one feed-forward layer `ffn` of `model` per train step on one device.

  tokens: own tokens per device; expert_group: E, the devices the layer's units are split over (sgatlin channels,
  FFF trees, MoE experts); d_group: G, the devices its tables' d_model is split over (sgatlin / PEER: the d-split
  gather; others: FSDP); devices: the devices that train the model (data-parallel gradient sums; default E G),
  all of them holding other tokens. placement: the tables' (dispatch.py); under fsdp and data the kernels see the
  device's own tokens and whole tables (E = G = 1), fsdp gathering them from all `devices`. microbatches: the
  step's micro-batch count.
  """
  if ffn.type not in _LAYERS:
    raise config_lib.ConfigError(f"no cost model for feed-forward type {ffn.type!r}; one of {', '.join(_LAYERS)}.")
  b = jnp.dtype(model.dtype).itemsize
  devices = devices or expert_group * d_group
  if placement != "expert":
    expert_group, d_group = 1, 1
  bld = _Builder(config_lib.remat_policy(model), placement, microbatches, devices)
  _LAYERS[ffn.type](bld, model, ffn, tokens, expert_group, d_group, b, devices)
  return bld.cost(ffn.type, tokens)


# From a config and a mesh -------------------------------------------------------------------------------------


def _axes_size(mesh_shape: dict, axes) -> int:
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return math.prod(mesh_shape.get(a, 1) for a in axes)


def groups(config, ffn, mesh_shape: dict) -> tuple[int, int]:
  """(E, G) of `ffn` under config.mesh.rules: sizes of the mesh axes of its units and of its tables' d_model."""
  spec, rules = SPECS[ffn.type], config.mesh.rules
  if spec.units is None and spec.neuron_table is None:
    return 1, _axes_size(mesh_shape, config_lib.rule_axes(rules, "embed"))
  names = spec.neuron_table or spec.units.table_axes
  table = expert_parallel.table_spec(names, rules)
  units = _axes_size(mesh_shape, table[names.index(spec.units.name)]) if spec.units is not None else 1
  return units, _axes_size(mesh_shape, table[names.index("embed")])


def tokens_per_device(config, mesh_shape: dict) -> int:
  """Own tokens per device: the global batch's tokens over the mesh axes of `batch`."""
  batch = _axes_size(mesh_shape, config_lib.rule_axes(config.mesh.rules, "batch"))
  return config.data.global_batch_size * config.data.seq_len // batch


def distinct_ffns(model) -> list[tuple[object, tuple, str]]:
  """(feed-forward sub-config, its layer indices, its config prefix) per distinct one (one unless mixed)."""
  by_ffn = {}
  for i in range(model.n_layers):
    ffn = config_lib.layer_ffn_config(model, i)
    prefix = "config.model.ffn" if ffn is model.ffn else "config.model.dense_ffn"
    by_ffn.setdefault(id(ffn), (ffn, [], prefix))[1].append(i)
  return [(ffn, tuple(layers), prefix) for ffn, layers, prefix in by_ffn.values()]


def remainder_cost(config, mesh_shape: dict) -> LayerCost:
  """The step without its feed-forward layers, analytically: attention blocks, embedding, head, their optimizer.

  Attention per block: q, k, v, out projections (matmuls), a fused attention kernel (reads q, k, v, writes o;
  4 T D FLOPs per token as the ladder counts them; its backward reads q, k, v, o, do, writes dq, dk, dv, 2.5x the
  FLOPs: recompute plus two gradient products), the head's [D, V] matmul with float32 logits and the loss reading
  them, the embedding rows. Its collectives are left to the compiled program (roofline.project_analytic).
  """
  model = config.model
  n, T = tokens_per_device(config, mesh_shape), config.data.seq_len
  D, V, layers = model.d_model, model.vocab_size, model.n_layers
  b = jnp.dtype(model.dtype).itemsize
  bld = _Builder(config_lib.remat_policy(model))
  block = _Builder(bld.remat)
  block.matmul("attention q, k, v", n, D, 3 * D, b, b, b)
  block.matmul("attention out", n, D, D, b, b, b)
  block.add("attention kernel", 4 * n * D * b, 4 * n * T * D, forward=True)
  block.add("attention kernel backward", 8 * n * D * b, 2.5 * 4 * n * T * D)
  for p in block.phases:
    bld.phases.append(Phase(f"{layers} x {p.name}", layers * p.nbytes, layers * p.flops, p.runs))
  bld.matmul("head", n, D, V, b, b, F32, forward_runs=False)
  bld.add("loss (logits read, dlogits written)", n * V * (F32 + b), 5 * n * V)
  bld.add("embedding rows and their gradient", n * D * (b + F32), 0)
  elements = 4 * D * D * layers + V * D * (1 if model.tie_embeddings else 2)
  bld.cast(elements, b)
  rules = config.mesh.rules
  shards = _axes_size(mesh_shape, config_lib.rule_axes(rules, "embed")) * _axes_size(
    mesh_shape, config_lib.rule_axes(rules, "heads")
  )
  bld.optimizer(elements / shards)
  return bld.cost("rest", n)


# Tables ---------------------------------------------------------------------------------------------------------


def _short(chip: hardware.Chip) -> str:
  return chip.name.replace(" SXM", "").replace("TPU ", "")


def format_layer(layers: tuple, cost: LayerCost, chips: list) -> str:
  """One layer's phases (bytes, FLOPs, time per chip), collectives, and the layer's time and HBM-bound share."""
  times = [time_on(cost, chip) for chip in chips]
  names = "".join(f"{_short(c) + ' us':>10}" for c in chips)
  span = f"layers {layers[0]}..{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
  lines = [
    f"{cost.name} feed-forward ({span}; per layer and device, {cost.tokens:,} tokens; sparsetx/train/layer_cost.py)",
    f"  {'phase':<50}{'runs':>5}{'MB':>10}{'GFLOP':>10}{names}",
  ]
  for i, p in enumerate(cost.phases):
    cells = "".join(f"{t.phase_s[i] * 1e6:>9.3g}{'*' if t.hbm_bound[i] else ' '}" for t in times)
    lines.append(f"  {p.name:<50}{p.runs:>5}{p.nbytes / 1e6:>10.4g}{p.flops / 1e9:>10.4g}{cells}")
  for c in cost.collectives:
    cells = "".join(f"{roofline.collective_seconds(c.op, c.nbytes, c.group, t.chip) * 1e6:>9.3g} " for t in times)
    label = f"{c.op} /{c.group}: {c.what}"
    lines.append(f"  {label:<50}{c.runs:>5}{c.nbytes / 1e6:>10.4g}{'':>10}{cells}")
  lines.append(
    f"  {'total':<50}{'':>5}{cost.nbytes / 1e6:>10.4g}{cost.flops / 1e9:>10.4g}"
    + "".join(f"{t.total_s * 1e6:>9.3g} " for t in times)
  )
  lines.append(f"  {'HBM-bound share of the layer time':<75}" + "".join(f"{t.hbm_share:>9.0%} " for t in times))
  lines.append(
    "  (* = HBM-bound phase: bytes / bandwidth > FLOPs / peak; time = max of the two; collectives ring time)"
  )
  return "\n".join(lines)


PAPER_TOKENS_PER_DEVICE = 128 * 2048 // 8  # the paper's setup: 128 x 2,048 tokens per step on 8 devices
PAPER_EXPERT_GROUP = 8


def ladder_rows(scales=(2, 5, 8), ffn_types=("sgatlin", "fff", "moe", "mlp"), tokens=PAPER_TOKENS_PER_DEVICE):
  """(type, scale, E, LayerCost, [LayerTime per chip]) per rung: the expert group is the largest divisor of
  PAPER_EXPERT_GROUP that divides the type's units (FFF's ladder has 4, 12, 20 trees: E = 4), 1 for dense types."""
  from sparsetx.models import ladder

  rows = []
  for ffn_type in ffn_types:
    for scale in scales:
      model = ladder.ladder_model_config(scale, ffn_type)
      spec = SPECS[ffn_type]
      E = math.gcd(model.ffn[spec.units.field], PAPER_EXPERT_GROUP) if spec.units is not None else 1
      cost = layer_cost(model, model.ffn, tokens, E, 1, devices=PAPER_EXPERT_GROUP)
      rows.append((ffn_type, scale, E, cost, [time_on(cost, chip) for chip in hardware.CHIPS.values()]))
  return rows


def format_ladder(rows) -> str:
  """A markdown table of ladder_rows: per-layer time (us), its HBM-bound and collective shares on each chip."""
  chips = list(hardware.CHIPS.values())
  head = " | ".join(f"{_short(c)} us (HBM, comm)" for c in chips)
  lines = [
    f"| type | scale | E | tables MB | GB moved | GFLOP | {head} |",
    "|---|---:|---:|---:|---:|---:|" + "---:|" * len(chips),
  ]
  for ffn_type, scale, E, cost, times in rows:
    cells = " | ".join(f"{t.total_s * 1e6:,.0f} ({t.hbm_share:.0%}, {t.comm_s / t.total_s:.0%})" for t in times)
    lines.append(
      f"| {ffn_type} | {scale} | {E} | {cost.table_bytes / 1e6:,.1f} | {cost.nbytes / 1e9:.2f} | {cost.flops / 1e9:,.0f}"
      f" | {cells} |"
    )
  return "\n".join(lines)

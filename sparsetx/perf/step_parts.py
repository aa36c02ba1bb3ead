"""Where a train step's device time goes: the named scopes that mark its parts in the program, and the reading of a
`jax.profiler` trace of the compiled step into milliseconds per part (sparsetx/tools/bench_step_parts.py).

Every op of a compiled program carries the scopes it was traced under in its metadata `op_name`, in the forward and
in its transpose alike; the trace names each executed op (`hlo_op`) and its program (`hlo_module`). So a part is the
device time of the ops whose op_name holds its scope (or, for attention and the dense feed-forward, the flax module
path). A fusion takes the op_name of its root, so fused neighbours count where the root does. Where a device runs
ops side by side (a CPU's threads), each instant is shared among them, so the parts add up to the step's busy time.
"""

import collections
import dataclasses
import glob
import re
from typing import NamedTuple

from sparsetx.perf import hlo_text
from sparsetx.scopes import COMBINE, LOSS, OPTIMIZER, ROUTER, ROW_GATHER, SEGMENT_SUMS, TABLE_GRADS

PARTS = (
  "attention",
  "ffn router + top-k",
  "row gathers",
  "table grads: sort",
  "table grads: segment sums",
  "table grads: combine",
  "ffn dense",
  "loss + lm head",
  "optimizer",
  "rest",
)


_TRANSFORMS_RE = re.compile(r"^(?:[\w]+\()+([\w.\-]+)\)+$")  # jvp(loss), transpose(jvp(Transformer))


def scopes(op_name: str) -> set:
  """The scope names along an op_name, each without the transformations JAX wraps it in (`jvp(loss)` -> loss)."""
  return {_TRANSFORMS_RE.sub(r"\1", part) for part in op_name.split("/")}


def part_of(op_name: str) -> str:
  """The part an op belongs to, by the scopes in its op_name (a named part wins over the module path)."""
  names = scopes(op_name)
  if OPTIMIZER in names:
    return "optimizer"
  if TABLE_GRADS in names:
    if COMBINE in names:
      return "table grads: combine"
    return "table grads: segment sums" if SEGMENT_SUMS in names else "table grads: sort"
  if ROW_GATHER in names:
    return "row gathers"
  if ROUTER in names:
    return "ffn router + top-k"
  if "mlp" in names:  # the block's feed-forward submodule: dense matmuls, a sparse layer's other work
    return "ffn dense"
  if LOSS in names or "lm_head" in names:
    return "loss + lm head"
  if "attention" in names:
    return "attention"
  return "rest"


_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name=\"([^\"]*)\"")


def op_names(compiled_text: str) -> dict:
  """{instruction name: op_name} of a compiled program's text (every computation: loop bodies, fusions)."""
  found = {}
  for line in compiled_text.splitlines():
    match = _INSTRUCTION_RE.match(line)
    if match:
      found[match[1]] = match[2]
  return found


class CompiledPart(NamedTuple):
  """A part of one run of a compiled program, read from its text (no device): what it launches and moves."""

  kernels: int  # launches per run (a loop body's once per trip)
  operand_bytes: int  # the arrays its launches are handed (hlo_text.Launch: a gathered table counts once)
  result_bytes: int  # the arrays they return


def compiled_parts(compiled_text: str) -> dict:
  """{part: CompiledPart} of a compiled program: its launches (hlo_text.launches) summed by part_of their op_name.
  What a program compiled for a GPU or TPU on this CPU launches, where no trace of it can be taken."""
  sums = {part: [0, 0, 0] for part in PARTS}
  for launch in hlo_text.launches(compiled_text):
    total = sums[part_of(launch.op_name)]
    total[0] += launch.runs
    total[1] += launch.runs * launch.operand_bytes
    total[2] += launch.runs * launch.result_bytes
  return {part: CompiledPart(*total) for part, total in sums.items()}


class TraceError(ValueError):
  """A trace that cannot be read into parts: none taken, none of its events the program's, or runs mixed up."""


@dataclasses.dataclass
class Breakdown:
  """One program's traced runs: the mean wall span of a run (first op's start to last op's end), and each part's
  share of it (seconds per run): each instant's time split equally among the ops running then, so the parts add up
  to the time any op ran, at most the span; the rest is the gaps between ops."""

  step_s: float
  parts_s: dict  # {part: seconds per run}
  runs: int

  @property
  def busy_s(self) -> float:
    return sum(self.parts_s.values())


def _owned_pieces(events) -> list:
  """(start_ns, end_ns, event) pieces of one timeline line: each instant belongs to the innermost event covering it
  (a loop or call op runs its body's ops inside its own span on a CPU; events on one line nest)."""
  order = sorted(events, key=lambda e: (e.start_ns, -e.duration_ns))
  bounds = sorted({e.start_ns for e in events} | {e.start_ns + e.duration_ns for e in events})
  pieces, stack, next_event = [], [], 0
  for start, end in zip(bounds, bounds[1:]):
    while next_event < len(order) and order[next_event].start_ns <= start:
      stack.append(order[next_event])
      next_event += 1
    while stack and stack[-1].start_ns + stack[-1].duration_ns <= start:
      stack.pop()
    if stack:
      pieces.append((start, end, stack[-1]))
  return pieces


def _shared_wall_time(pieces) -> collections.Counter:
  """{key: seconds} of (start_ns, end_ns, key) pieces from every line: each instant's wall time shared equally among
  the pieces running then, so the keys' times add up to the time anything ran (at most the run's span), however
  many ops a CPU runs side by side."""
  edges = sorted(
    [(start, 1, n) for n, (start, _, _) in enumerate(pieces)] + [(end, -1, n) for n, (_, end, _) in enumerate(pieces)]
  )
  shares, active, last = collections.Counter(), set(), None
  for time, change, n in edges:
    if active and last is not None and time > last:
      for m in active:
        shares[pieces[m][2]] += (time - last) * 1e-9 / len(active)
    last = time
    (active.add if change > 0 else active.discard)(n)
  return shares


def _op_events(profile, module_prefix: str) -> dict:
  """{line id: [(event, hlo_op, run id)]} of the ops of modules named module_prefix*: the device planes' (GPU
  streams, TPU "XLA Ops") where a device plane holds events, else the host's (a CPU runs the program on host
  threads). A device plane's events that none match mean a trace this reader does not know: it says so, rather
  than read the host's launches as the device's time."""
  device, host = collections.defaultdict(list), collections.defaultdict(list)
  device_events = 0
  for p, plane in enumerate(profile.planes):
    on_device = plane.name.startswith("/device:")
    for j, line in enumerate(plane.lines):
      for event in line.events:
        device_events += on_device
        stats = dict(event.stats)
        op, module = stats.get("hlo_op"), str(stats.get("hlo_module", ""))
        if op is None and on_device and line.name == "XLA Ops":
          op, module = event.name, module or module_prefix
        if op is None or not module.startswith(module_prefix):
          continue
        (device if on_device else host)[p, j].append((event, str(op), stats.get("run_id", 0)))
  if device_events and not device:
    planes = sorted({plane.name for plane in profile.planes if plane.name.startswith("/device:")})
    raise TraceError(
      f"the trace's device planes ({', '.join(planes)}) hold {device_events} events, none of them an op of a program "
      f"named {module_prefix}* (no hlo_op and hlo_module stats): this trace format is not one "
      "perf/step_parts.py reads, so it cannot tell the device's time by part."
    )
  return device or host


def read_trace(trace_dir: str, compiled_text: str, module_prefix: str, rounds: int) -> Breakdown:
  """The breakdown of the `rounds` runs of one compiled program (its text, its module's name prefix) traced in a
  trace directory."""
  files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
  if not files:
    raise TraceError(f"no profiler trace (*.xplane.pb) under {trace_dir}.")
  from jax.profiler import ProfileData  # noqa: PLC0415 (only the benchmark reads traces)

  return read_profile(ProfileData.from_file(max(files)), compiled_text, module_prefix, rounds)


def read_profile(profile, compiled_text: str, module_prefix: str, rounds: int) -> Breakdown:
  """read_trace's breakdown of a loaded profile (jax.profiler.ProfileData: planes of lines of events)."""
  names = op_names(compiled_text)
  pieces, spans = [], collections.defaultdict(lambda: [float("inf"), 0.0])  # run id: [first start, last end]
  for events in _op_events(profile, module_prefix).values():
    part = {id(event): part_of(names.get(op, "")) for event, op, _ in events}
    for event, _, run in events:
      span = spans[run]
      span[0], span[1] = min(span[0], event.start_ns), max(span[1], event.start_ns + event.duration_ns)
    pieces += [(start, end, part[id(event)]) for start, end, event in _owned_pieces([e for e, _, _ in events])]
  if not spans:
    raise TraceError(f"the trace holds no op of a program named {module_prefix}*.")
  if len(spans) != rounds:
    raise TraceError(
      f"the trace holds {len(spans)} runs of {module_prefix}* (by their run_id stats), not the {rounds} traced: "
      "a span or a mean per run would mix them, so no breakdown is read."
    )
  parts = _shared_wall_time(pieces)
  mean_span = sum((end - start) * 1e-9 for start, end in spans.values()) / rounds
  return Breakdown(mean_span, {part: parts[part] / rounds for part in PARTS}, rounds)

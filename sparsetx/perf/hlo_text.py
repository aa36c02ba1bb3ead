"""Reading a compiled (HLO) or lowered (StableHLO) program's text: its collectives and their replica groups, its
loops and their trip counts, the kernels it launches. The dry run, the compile suite and the roofline read the
programs of sparsetx/measure/aot.py through these."""

import collections
import math
import re
from typing import NamedTuple

import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "ragged-all-to-all", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "bf16": 2,
  "f16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}
_COLLECTIVE_RE = re.compile(r"=\s*(?P<shape>.*?)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\(")
_ARRAY_RE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


class Collective(NamedTuple):
  op: str
  nbytes: int  # the result's bytes on one device
  group: int  # devices per replica group
  shape: str
  source: str  # the jax op_name it came from (jvp(...) forward, transpose(...) backward)
  granules: int = 1  # nodes / slices its largest replica group spans (> 1: part of it crosses the DCN)
  elements: int = 0  # the result's elements on one device (all arrays of a combined collective)


def collectives(hlo_text: str, granule_of_id=None) -> list:
  """A Collective for each collective instruction in a compiled HLO text. `granule_of_id` maps a replica-group
  id (a position in the program's device assignment) to its node / slice (dcn_granules); None: all one."""
  found = []
  for line in hlo_text.splitlines():
    match = _COLLECTIVE_RE.search(line)
    if not match:
      continue
    result = async_result(match["shape"]) if match["start"] else match["shape"]
    arrays = [(dtype, math.prod(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY_RE.findall(result)]
    nbytes = sum(_DTYPE_BYTES[dtype] * n for dtype, n in arrays)
    source = _OP_NAME_RE.search(line)
    groups = replica_groups(line) if granule_of_id else None
    spans = max((len({granule_of_id[i] for i in group}) for group in groups), default=1) if groups else 1
    found.append(
      Collective(
        match["op"],
        nbytes,
        _group_size(line),
        match["shape"].split("{")[0],
        source[1] if source else "",
        spans,
        sum(n for _, n in arrays),
      )
    )
  return found


def async_result(shape: str) -> str:
  """The result part of an asynchronous collective's start shape: XLA writes `(operands, results)`, e.g.
  `((bf16[8]{0}), bf16[8]{0})` for an all-reduce-start (jax 0.12's GPU compiler) or `(f32[2]{0}, f32[8]{0})` for an
  all-gather-start: the last top-level element."""
  if not shape.startswith("("):
    return shape
  depth, last = 0, 1
  for i, char in enumerate(shape):
    if char in "({[":
      depth += 1
    elif char in ")}]":
      depth -= 1
    elif char == "," and depth == 1:
      last = i + 1
  return shape[last:-1].strip()


def _iota(dims: str, perm: str | None) -> np.ndarray:
  """XLA's iota tile assignment: arange reshaped to `dims`, transposed by `perm`."""
  shape = [int(d) for d in dims.split(",")]
  ids = np.arange(math.prod(shape)).reshape(shape)
  return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def replica_groups(line: str) -> list | None:
  """The device ids of each replica group of a collective instruction (mesh, iota or explicit form; a
  collective-permute's source-target pairs as groups of two); None when the line has none of them."""
  mesh = re.search(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]*)\](?:T\(([\d,]*)\))?\))? \{([^}]*)\}", line
  )
  if mesh:
    names = re.findall(r"'(\w+)'=(\d+)", mesh[1])
    sizes = [int(size) for _, size in names]
    ids = _iota(mesh[2], mesh[3]) if mesh[2] else np.arange(math.prod(sizes))
    ids = ids.reshape(sizes)
    grouped = [i for i, (name, _) in enumerate(names) if f"'{name}'" in mesh[4]]
    rest = [i for i in range(len(names)) if i not in grouped]
    size = math.prod(sizes[i] for i in grouped)
    return ids.transpose(rest + grouped).reshape(-1, size).tolist()
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?", line)
  if iota:
    return _iota(iota[3], iota[4]).reshape(int(iota[1]), int(iota[2])).tolist()
  explicit = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
  if explicit:
    return [[int(i) for i in group.split(",") if i] for group in re.findall(r"\{([\d,]*)\}", explicit[1])]
  return None


def dcn_granules(mesh, granule_of: dict) -> dict:
  """Replica-group id -> node / slice: the ids index the program's device assignment, the mesh's devices in
  order; `granule_of` maps a device id to its granule (mesh_lib.granule_of)."""
  return {i: granule_of[d.id] for i, d in enumerate(mesh.devices.flat)}


def _group_size(line: str) -> int:
  """Devices per group, from the iota ([groups,size]), explicit ({{..}}) or mesh-axes replica groups."""
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)
  if mesh:
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh[1]))
    return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh[2]))
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  if iota:
    return int(iota[2])
  explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  if explicit:
    return len(explicit[1].split(","))
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}?", line)
  return 2 if pairs else 0


_INSTRUCTION_RE = re.compile(
  r"^\s*(?:ROOT )?%(?P<instruction>[\w-]+)[\w.-]* = .*?custom_call_target=\"(?P<target>[^\"]+)\""
)
_PALLAS_NAME_RE = re.compile(r'op_name="[^"]*/(?:\w+\()*(\w+)\)*/pallas_call"')  # .../transpose(jvp(name))/pallas_call


def compiled_kernels(hlo_text: str) -> collections.Counter:
  """{(custom-call target, kernel name): count} of a compiled program: the Pallas kernel's name (from its op
  name, or a Mosaic TPU call's instruction name, which libtpu takes from the kernel); '' for other calls."""
  found = collections.Counter()
  for line in hlo_text.splitlines():
    call = _INSTRUCTION_RE.match(line)
    if call:
      name = _PALLAS_NAME_RE.search(line)
      name = name[1] if name else call["instruction"] if call["target"] == "tpu_custom_call" else ""
      found[call["target"], name] += 1
  return found


_COMPUTATION_RE = re.compile(r"^(?:ENTRY )?%([\w.-]+) .*\{$")
_WHILE_RE = re.compile(r" while\(.*condition=%([\w.-]+), body=%([\w.-]+)")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_S32_CONSTANT_RE = re.compile(r"= s32\[\](?:\{[^}]*\})? constant\((\d+)\)")


def computations(hlo_text: str) -> dict:
  """{computation name: its instruction lines} of a compiled HLO module's text."""
  blocks, name = {}, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION_RE.match(line)
    if header:
      name = header[1]
      blocks[name] = []
    elif line == "}":
      name = None
    elif name is not None:
      blocks[name].append(line)
  return blocks


class Loop(NamedTuple):
  body: str  # the body computation's name
  trips: int | None  # the known trip count, or the constant the condition compares with; None if neither


def compiled_loops(hlo_text: str) -> list:
  """A Loop for each `while` of a compiled program: what the device runs in sequence."""
  blocks = computations(hlo_text)
  loops = []
  for lines in blocks.values():
    for line in lines:
      found = _WHILE_RE.search(line)
      if not found:
        continue
      trips = _TRIP_RE.search(line)
      if trips is None:
        constants = [int(c) for c in _S32_CONSTANT_RE.findall("\n".join(blocks.get(found[1], [])))]
        trips = max(constants) if constants else None
      else:
        trips = int(trips[1])
      loops.append(Loop(found[2], trips))
  return loops


_ENTRY_RE = re.compile(r"^ENTRY %([\w.-]+) ")
_LINE_RE = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (.*?) ([a-z][a-z0-9-]*)\(")
# Instructions that name, pick or wrap values without running anything (a loop's body runs as its own).
_NOT_LAUNCHED = {
  "parameter",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "constant",
  "while",
  "after-all",
  "opt-barrier",
  "partition-id",
  "replica-id",
  "add-dependency",
}


class Launch(NamedTuple):
  """One instruction a run of a compiled program launches: a fusion, custom call (a Pallas kernel, cuDNN), copy,
  sort, collective or other unfused op."""

  op_name: str  # the jax op_name it came from (its named scopes)
  opcode: str
  operand_bytes: int  # the arrays it is handed (a gather's whole table, once), not what it reads of them
  result_bytes: int  # what it returns (an in-place update's whole buffer)
  runs: int  # times one run of the program launches it: the trips of the loops around it


def array_bytes(shape: str) -> int:
  """Bytes of every array in an HLO shape (a tuple's summed)."""
  arrays = _ARRAY_RE.findall(shape)
  return sum(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d) for dtype, dims in arrays)


def _operands(line: str, open_at: int) -> list:
  """The %names between the opcode's parenthesis at `open_at` and its match (not the attributes after it)."""
  depth = 0
  for end in range(open_at, len(line)):
    depth += {"(": 1, ")": -1}.get(line[end], 0)
    if depth == 0:
      break
  return re.findall(r"%([\w.-]+)", line[open_at:end])


def launches(hlo_text: str) -> list:
  """A Launch for each instruction the entry computation, the computations it calls and its loops' bodies run
  (nested loops multiply their trips; a loop of unknown trips counts once); fused computations and reducers run
  inside their instruction."""
  blocks = computations(hlo_text)
  trips = {loop.body: loop.trips or 1 for loop in compiled_loops(hlo_text)}
  entry = next((m[1] for m in map(_ENTRY_RE.match, hlo_text.splitlines()) if m), None)
  found, pending = [], [(entry, 1)] if entry in blocks else []
  while pending:
    name, runs = pending.pop()
    sizes = {}
    for line in blocks[name]:
      match = _LINE_RE.match(line)
      if not match:
        continue
      sizes[match[1]] = array_bytes(match[2])
      body = _WHILE_RE.search(line)
      if body:
        pending.append((body[2], runs * trips.get(body[2], 1)))
      if match[3] == "call":  # runs its computation in place (a CPU wraps each loop in one)
        pending.append((re.search(r"to_apply=%([\w.-]+)", line)[1], runs))
        continue
      if match[3] in _NOT_LAUNCHED or match[3].endswith("-done"):
        continue
      operands = _operands(line, match.end() - 1)
      op_name = _OP_NAME_RE.search(line)
      found.append(
        Launch(op_name[1] if op_name else "", match[3], sum(sizes.get(o, 0) for o in operands), sizes[match[1]], runs)
      )
  return found


def collectives_by_computation(hlo_text: str) -> dict:
  """{computation name: [Collective]} of a compiled program (where each collective sits: a loop body's run every
  trip)."""
  return {name: collectives("\n".join(lines)) for name, lines in computations(hlo_text).items()}


_CUSTOM_CALL_RE = re.compile(r"stablehlo\.custom_call @([\w$.]+)")
# The kernel's name: Pallas TPU's kernel_name, Triton's name in its backend config (pallas_call(name=...)).
_KERNEL_NAME_RE = re.compile(r'\b(?:kernel_)?name = "([^"]*)"')


def custom_calls(lowered_text: str) -> collections.Counter:
  """How often each (custom-call target, kernel name) appears in a lowered (StableHLO) program's text.

  The name is the Pallas kernel's for TPU (tpu_custom_call) and Triton (__gpu$xla.gpu.triton) calls, ''
  where the call carries none (Mosaic GPU, cuDNN, XLA's own)."""
  found = collections.Counter()
  for line in lowered_text.splitlines():
    target = _CUSTOM_CALL_RE.search(line)
    if target:
      name = _KERNEL_NAME_RE.search(line, target.end())
      found[target[1], name[1] if name else ""] += 1
  return found


_CONSTANT_RE = re.compile(r"(%[\w#]+) = stablehlo\.constant dense<(-?\d+)> : tensor<i\d+>")
_COMPARE_RE = re.compile(r"stablehlo\.compare\s+LT, %[\w#]+, (%[\w#]+)")


def while_loops(lowered_text: str) -> list:
  """The trip count of each `stablehlo.while` in a lowered program, in program order (None where the bound is
  not a constant): what a device would run sequentially. A scan lowers to a loop whose condition compares its
  counter (from 0) with a constant; that constant is the count."""
  lines = lowered_text.splitlines()
  trips = []
  for i, line in enumerate(lines):
    if "stablehlo.while" not in line:
      continue
    found = next(((j, m) for j, m in enumerate(map(_COMPARE_RE.search, lines[i : i + 40]), i) if m), None)
    bound = None
    if found:
      j, compare = found
      for earlier in reversed(lines[:j]):
        constant = _CONSTANT_RE.search(earlier)
        if constant and constant[1] == compare[1]:
          bound = int(constant[2])
          break
    trips.append(bound)
  return trips


def format_custom_calls(calls: collections.Counter) -> str:
  """A table of custom_calls(...): target, kernel name, count (the kernels the lowered program would launch)."""
  lines = [f"  {'custom-call target':<30}{'kernel':<42}{'count':>6}"]
  lines += [f"  {target:<30}{name or '-':<42}{count:>6}" for (target, name), count in sorted(calls.items())]
  return "\n".join(lines if calls else lines + ["  (none: XLA's own code only)"])

"""The device chooses its kernels: for each kernel op and shape class a step runs, every implementation that lowers
here is timed on the device the table entry names, its values checked against XLA's on inputs shaped like
training's (ragged groups, hot rows), and the fastest correct one is kept in the autotune table
(kernels/autotune_table.py) with the reason each other one was dropped.

Each candidate runs in a child process (`python -m sparsetx.plan.autotune JSON`), which reports the device it ran
on: a kernel that faults takes only its own process down. A TPU cannot be shared with a child, so there the
candidates run in this process, one at a time. A candidate is a registry name, or `module:attribute` (the tests'
fakes). More: docs/modules.md, sparsetx/plan/autotune.py.
"""

import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparsetx.config import ConfigError
from sparsetx.kernels import autotune_table, registry
from sparsetx.kernels.device import target
from sparsetx.kernels.fff.tree_route import WALK_ROWS_PER_CHUNK
from sparsetx.kernels.grouped_matmul import op as grouped_op
from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows.gated_gather import gated_gather
from sparsetx.kernels.rows.reference import ACTIVATIONS, Gating
from sparsetx.perf import timing

PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"
RESULT_MARK = "autotune result: "
CHILD_TIMEOUT_S = 300
DEFAULT_BUDGET_S = 600.0  # the trainer's start-up default (config.train.autotune_budget_s)
U32 = 2.0**-24
REASSOCIATION = 4  # another summation order (tree, split-k) is allowed this many float32 roundings per term
D_AXIS = "d_split"  # the one-device mesh axis the d-split form is measured over


@dataclasses.dataclass
class Measured:
  name: str
  ms: float | None = None  # None: dropped
  why: str | None = None
  device: str | None = None  # the device kind it ran on (None: it never said, e.g. it faulted)


class NotMeasured(Exception):
  """A call nothing is recorded for: `auto` keeps the default order (or a nearby entry) for it."""


class WrongDevice(NotMeasured):
  """The candidates could not run on the device the entry names (a child fell back to another)."""


class OutOfBudget(NotMeasured):
  """The budget ran out before every candidate of the call was measured."""


def candidate(op: str, spec: str):
  """The implementation a spec names: a registry name, or module:attribute, either with `@knob=value,...` (a
  tiling, Rows.at_tiling)."""
  if ":" not in spec:
    return registry.by_name(op, spec)
  spec, _, tiling = spec.partition("@")
  module, _, attribute = spec.partition(":")
  implementation = getattr(importlib.import_module(module), attribute)
  return registry.at_tiling(op, implementation, tiling) if tiling else implementation


def measurable(call: dict) -> bool:
  """Whether the autotuner can make this call again (a layer's activation it knows by name)."""
  return call.get("activation", "identity") in ACTIVATIONS


def skewed_rows(tokens: int, slots: int, rows: int, chunk: int, seed: int = 0) -> np.ndarray:
  """[N, S] int32 table rows as routing picks them: three quarters of the slots Zipf-skewed (p ~ 1 / rank over a
  shuffled table, as product keys and FFF's upper levels concentrate), a quarter uniform, and one hot row in the
  first slot of min(N, 2 chunk + chunk // 2 + 1) tokens, so that with chunk = segment_chunk it has a head, a full
  tail chunk and a partial one: the table gradients' cut-and-combine path runs."""
  rng = np.random.default_rng(seed)
  shuffled = rng.permutation(rows)
  p = 1.0 / np.arange(1, rows + 1)
  picked = shuffled[rng.choice(rows, size=(tokens, slots), p=p / p.sum())]
  picked = np.where(rng.random((tokens, slots)) < 0.25, rng.integers(0, rows, (tokens, slots)), picked)
  picked[: min(tokens, 2 * chunk + chunk // 2 + 1), 0] = shuffled[0]
  return picked.astype(np.int32)


def ragged_sizes(rows: int, groups: int, seed: int = 0) -> np.ndarray:
  """[E] int32 group sizes as a router makes them: uneven and not multiples of any tile, group 1 empty, and the
  last rows/16 after every group (pairs routed to another device's experts, which the op leaves at zero)."""
  rng = np.random.default_rng(seed)
  p = rng.dirichlet(np.full(groups, 0.7))
  if groups > 1:
    p[1] = 0.0
  return rng.multinomial(rows - rows // 16, p / p.sum()).astype(np.int32)


def inputs(call: dict, options: KernelOptions) -> tuple:
  """Random operands of the call's shapes and dtypes (the program's arguments, then its constants): the tables in
  the call's table dtype (bf16 parameters stay bf16), rows from skewed_rows, group sizes from ragged_sizes."""
  k = jax.random.split(jax.random.key(0), 7)
  dtype = jnp.dtype(call["dtype"])
  if call["form"] == "gather":
    N, D, S, R, table = call["tokens"], call["d_model"], call["slots"], call["rows"], jnp.dtype(call["table_dtype"])
    x = jax.random.normal(k[0], (N, D), dtype)
    w_in, w_out = ((jax.random.normal(key, (R, D), jnp.float32) / D**0.5).astype(table) for key in k[1:3])
    gates = jax.random.normal(k[3], (N, S), jnp.float32)
    bias = jax.random.normal(k[4], (R,), table) if call["bias"] else None
    rows = jnp.asarray(skewed_rows(N, S, R, options.segment_chunk))
    dy = jax.random.normal(k[6], (N, D), dtype)
    h = None
    if call["given_h"]:  # FFF's walk hands the gather its logits: XLA's pre-activations of these operands
      xla = registry.by_name("rows", "xla")
      h = jax.jit(lambda *a: xla.forward(*a, Gating(), KernelOptions("xla"))[1])(x, w_in, w_out, rows, gates, bias)
    return (x, w_in, w_out, gates) + (() if bias is None else (bias,)), (rows, dy, h)
  if call["form"] == "walk":  # small integers: every dot is exact, so each implementation walks the same path
    N, D, P, M, start = call["tokens"], call["d_model"], call["trees"], call["nodes"], call["start"]
    x = jax.random.randint(k[0], (N, D), -2, 3).astype(dtype)
    w_in = (jax.random.randint(k[1], (P, M, D), -2, 3) / 4).astype(call["table_dtype"])
    b_in = (jax.random.randint(k[2], (P, M), -8, 9) / 4).astype(call["table_dtype"])
    node = jax.random.randint(k[3], (N, P), 2**start - 1, 2 ** (start + 1) - 1).astype(jnp.int32)
    return (x, w_in, b_in, node), ()
  S, K, N, E = call["rows"], call["k"], call["n"], call["experts"]
  lhs = jax.random.normal(k[0], (S, K), dtype)
  rhs = (jax.random.normal(k[1], (E, K, N), jnp.float32) / K**0.5).astype(call.get("table_dtype", "float32"))
  dout = jax.random.normal(k[2], (S, N), dtype)
  return (lhs, rhs), (jnp.asarray(ragged_sizes(S, E)), dout)


def reference_options(op: str, options: KernelOptions) -> KernelOptions:
  """The options XLA's implementation is the reference under: for the grouped matmul jax.lax.ragged_dot itself
  (on a CPU XLA's record otherwise runs row-tiled loops, which would check XLA against XLA)."""
  return options._replace(implementation="reference" if op == "grouped_matmul" else "xla")


def program(call: dict, implementation, options: KernelOptions, constants: tuple):
  """The jitted call as the step makes it, forward and backward where the step differentiates it (the d-split form
  where the call has it): {name: output or gradient}, what the check compares."""
  if call["form"] == "gather":
    rows, dy, h = constants
    gating = dict(activation=ACTIVATIONS[call["activation"]], gate_inside_activation=call["gate_inside"])
    run = dict(options=options, implementation=implementation, **gating)

    def gather(x, w_in, w_out, gates, bias):
      if not call.get("d_split"):
        return gated_gather(x, w_in, w_out, rows, gates, bias_R=bias, pre_activation=h, **run)
      # a d-split call: this device's d-slice, its partial dots summed over the d-group (here of one device)
      mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (D_AXIS,))
      sliced = lambda x, w_in, w_out, rows, gates: gated_gather(x, w_in, w_out, rows, gates, sum_axes=(D_AXIS,), **run)  # noqa: E731
      replicated = jax.sharding.PartitionSpec()
      return jax.shard_map(sliced, mesh=mesh, in_specs=replicated, out_specs=replicated)(x, w_in, w_out, rows, gates)

    def loss(x, w_in, w_out, gates, bias=None):
      y = gather(x, w_in, w_out, gates, bias)
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    names = ("dx", "dw_in", "dw_out", "dgates", "dbias")[: 5 if call["bias"] else 4]
    value_and_grads = jax.value_and_grad(loss, argnums=tuple(range(len(names))), has_aux=True)

    def outputs(*args):
      (_, y), grads = value_and_grads(*args)  # the loss is left out: a function of y, which is checked itself
      return dict(y=y, **dict(zip(names, grads)))

    return jax.jit(outputs)
  if call["form"] == "walk":
    levels = call["levels"]
    walk = lambda x, w, b, node: implementation.walk(options, x, w, b, node, levels, WALK_ROWS_PER_CHUNK)  # noqa: E731
    return jax.jit(lambda *a: dict(zip(("nodes", "logits"), walk(*a))))
  sizes, dout = constants

  def grouped_loss(lhs, rhs):
    out = grouped_op.run(implementation, lhs, rhs, sizes, options)
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

  value_and_grads = jax.value_and_grad(grouped_loss, argnums=(0, 1), has_aux=True)

  def outputs(lhs, rhs):
    (_, out), (dlhs, drhs) = value_and_grads(lhs, rhs)
    return dict(out=out, dlhs=dlhs, drhs=drhs)

  return jax.jit(outputs)


def bounds(call: dict, constants: tuple) -> dict:
  """{output: (dtype its terms are rounded to, the most terms one of its values sums)}, for worst_error.

  The forward and x's gradient round their slot coefficients to the call's dtype (the d-split's float32 y too);
  the table and gate gradients sum float32 products of values exact in float32, so float32 tables get float32
  slack and bf16 tables their own rounding; the grouped matmul's three outputs are the lhs dtype's (its weight
  gradient is summed in it, as ragged_dot's is). Integer outputs (a walk's nodes) must be equal."""
  dtype = jnp.dtype(call["dtype"])
  if call["form"] == "gather":
    D, S, table = call["d_model"], call["slots"], jnp.dtype(call["table_dtype"])
    # A table row's gradient sums its own pairs (each coefficient a float32 dot of D terms): its own count, so a row
    # few tokens pick is held to its own bound, not the hot row's.
    pairs_R = np.bincount(np.asarray(constants[0]).reshape(-1), minlength=call["rows"]) + D
    found = dict(y=(dtype, max(D, S)), dx=(dtype, max(D, S)), dgates=(jnp.dtype(jnp.float32), D))
    found.update(dw_in=(table, pairs_R), dw_out=(table, pairs_R), dbias=(table, pairs_R))
    return found
  if call["form"] == "walk":
    return dict(nodes=(dtype, call["d_model"]), logits=(dtype, call["d_model"]))
  largest = int(np.asarray(constants[0]).max(initial=0))
  weights = jnp.dtype(call.get("table_dtype", dtype))
  coarser = max(dtype, weights, key=lambda d: float(jnp.finfo(d).eps))  # the weights' gradient is rounded to both
  return dict(out=(dtype, call["k"]), dlhs=(dtype, call["n"]), drhs=(coarser, max(largest, 1)))


def worst_error(got: dict, want: dict, bound_of: dict) -> float:
  """The largest |got - want| over its bound, across every output: bound = 2 u |want| + REASSOCIATION n u32 max|want|
  with (u's dtype, n) from `bounds` per output, i.e. two roundings to that dtype plus float32 sums of n terms in
  another order (n per row where `bounds` gives one count per row: the output's largest value, a sum of many terms,
  bounds any term; a row's own |want| would not, where its terms cancel); integer outputs must be equal (else inf)."""
  worst = 0.0
  for name, b in want.items():
    a, b = np.asarray(got[name]), np.asarray(b)
    if np.issubdtype(b.dtype, np.integer):
      worst = max(worst, 0.0 if np.array_equal(a, b) else np.inf)
      continue
    dtype, n = bound_of[name]
    u = float(jnp.finfo(dtype).eps) / 2
    a, b = a.astype(np.float64), b.astype(np.float64)
    if np.ndim(n):  # one count per row (a table gradient): each row's own terms
      n = np.asarray(n, np.float64).reshape((-1,) + (1,) * (b.ndim - 1))
    scale = max(float(np.abs(b).max(initial=0.0)), np.finfo(np.float32).tiny)
    bound = 2 * u * np.abs(b) + REASSOCIATION * n * U32 * scale
    worst = max(worst, float(np.max(np.abs(a - b) / bound, initial=0.0)))
  return worst


def this_device() -> str:
  """The kind of device this process runs its programs on (what a measurement here times)."""
  return jax.devices()[0].device_kind


def measure_here(op: str, spec: str, call: dict, options: KernelOptions, rounds: int) -> Measured:
  """One candidate in this process: refused, wrong values (outputs or gradients), or its median milliseconds;
  `device` names where it ran."""
  here = this_device()
  implementation = candidate(op, spec)
  options = registry.naming(implementation, options)
  try:
    implementation.refuse(target(), options, call)
  except NotImplementedError as why:
    return Measured(spec, why=f"raised: {why}", device=here)
  args, constants = inputs(call, options)
  step = program(call, implementation, options, constants)
  try:
    got = jax.block_until_ready(step(*args))
  except NotImplementedError as why:  # a kernel that does not lower for these operands
    return Measured(spec, why=f"raised: {str(why).splitlines()[0] if str(why) else type(why).__name__}", device=here)
  reference = registry.by_name(op, "xla")
  want = program(call, reference, reference_options(op, options), constants)(*args)
  error = worst_error(got, want, bounds(call, constants))
  if not error <= 1.0:
    return Measured(spec, why=f"wrong values: {error:.3g} times the bound against XLA's", device=here)
  ms = 1e3 * timing.interleaved({spec: lambda: step(*args)}, rounds, warm=False)[spec]
  return Measured(spec, ms=ms, device=here)


def child_environment() -> dict:
  """This process's environment, plus its compilation cache directory (the trainer's workdir cache) where one is
  set: a restart's children read the candidates' compiled programs instead of compiling them again."""
  env = dict(os.environ)
  if jax.config.jax_compilation_cache_dir:
    env[CACHE_DIR] = str(jax.config.jax_compilation_cache_dir)
  return env


def measure(op: str, spec: str, call: dict, options: KernelOptions, rounds: int, timeout_s=None) -> Measured:
  """One candidate in a child process; one that dies (a signal, an exit), or exits non-zero after answering, is
  dropped as faulted, one that does not answer in `timeout_s` (default CHILD_TIMEOUT_S) as timed out."""
  timeout_s = CHILD_TIMEOUT_S if timeout_s is None else timeout_s
  request = json.dumps(dict(op=op, spec=spec, call=call, options=options._asdict(), rounds=rounds))
  try:
    result = subprocess.run(
      [sys.executable, "-m", "sparsetx.plan.autotune", request],
      capture_output=True,
      text=True,
      timeout=timeout_s,
      env=child_environment(),
    )
  except subprocess.TimeoutExpired:
    return Measured(spec, why=f"timed out: no answer in {timeout_s:g} s")
  code = result.returncode
  how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
  last = (result.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1][:200]
  for line in reversed(result.stdout.splitlines()):
    if line.startswith(RESULT_MARK):
      answered = Measured(**json.loads(line[len(RESULT_MARK) :]))
      if code != 0:  # its device may be left in any state: nothing it timed is trusted
        return Measured(spec, why=f"faulted: {how} after it answered: {last}", device=answered.device)
      return answered
  return Measured(spec, why=f"faulted: {how}: {last}")


class Hung(NotMeasured):
  """A candidate measured in this process did not finish within its cap: the device is held by a program nothing
  can cancel, so the process must end (tune records the verdict first)."""


def measure_in_process(op: str, spec: str, call: dict, options: KernelOptions, rounds: int, cap_s: float) -> Measured:
  """One candidate in this process (a TPU, which a child cannot open): the same gate as a child's; an exception is
  dropped as faulted; one still running after `cap_s` raises Hung (it runs in a daemon thread, so the wait ends)."""
  done = {}

  def run():
    try:
      done["measured"] = measure_here(op, spec, call, options, rounds)
    except Exception as error:  # noqa: BLE001 (a child would have died of it: dropped, and the next one measured)
      first = (str(error).splitlines() or [""])[0][:200]
      done["measured"] = Measured(spec, why=f"faulted: raised {type(error).__name__}: {first}", device=this_device())

  worker = threading.Thread(target=run, name=f"sparsetx-autotune-{spec}", daemon=True)
  worker.start()
  worker.join(cap_s)
  if worker.is_alive():
    raise Hung(f"{spec} ran for more than {cap_s:g} s in this process")
  return done["measured"]


def in_process() -> bool:
  """Whether candidates run in this process: a TPU, which the process that traced the step holds (a child would
  fall back to the CPU)."""
  return target().platform == "tpu"


def leave_device_memory_to_children() -> None:
  """Called by a program before JAX starts when it will measure kernels (will_measure): its own client then
  allocates as used, not 75% of the GPU up front, so each candidate's child process finds the memory it needs."""
  os.environ.setdefault(PREALLOCATE, "false")


def will_measure(config, spec=None) -> bool:
  """Whether the trainer may measure kernels at start-up (then it leaves the GPU's memory to the children), from
  the config and the environment only, before JAX starts: autotune on, kernel implementation `auto`, a sparse
  feed-forward layer (its kernels are what is measured), and one process (`spec`: parallel/distributed.detect's,
  default from os.environ)."""
  from sparsetx.models.ffn.registry import SPECS  # noqa: PLC0415 (kept out of the children's start)
  from sparsetx.parallel import distributed  # noqa: PLC0415

  if not (config.train.get("autotune", True) and config.model.ffn.kernel.get("implementation", "auto") == "auto"):
    return False
  if config.train.get("autotune_budget_s", DEFAULT_BUDGET_S) <= 0:
    return False
  if not SPECS[config.model.ffn.type].sparse:
    return False
  spec = distributed.detect(os.environ) if spec is None else spec
  return not spec.multi_process or spec.num_processes == 1


def check_parent() -> None:
  """Refuses to spawn candidates from a process that holds most of a GPU's memory: each would fault for want of
  it, and every implementation, XLA included, would be dropped."""
  if target().platform == "gpu" and os.environ.get(PREALLOCATE, "true").lower() not in ("false", "0"):
    raise ConfigError(
      f"this process preallocates most of the GPU's memory, which the autotuner's child processes need; set "
      f"{PREALLOCATE}=false before JAX starts (sparsetx-train and sparsetx-autotune do) or fill the table with "
      f"sparsetx-autotune."
    )


def ready_to_measure() -> None:
  """Before minutes of measuring: the children will find the GPU's memory, and the table can be written."""
  check_parent()
  autotune_table.check_writable()


def specs_for(op: str, tilings: bool = False) -> list:
  """What this device runs of `op` (registry.runs_here: on a CPU, XLA's designs; interpreted kernels only when
  named), XLA first (the reference), and with `tilings` each one's offered tilings beside the config's."""
  specs = []
  for i in sorted(registry.runs_here(op), key=lambda i: i.name != "xla"):
    specs += [i.name] + [registry.tiling_spec(i, tiling) for tiling in (i.tilings if tilings else ())]
  return specs


def tune(op: str, key: str, call: dict, options: KernelOptions, specs=None, rounds=5, tilings=False, deadline=None):
  """Measures every candidate (default: specs_for(op, tilings)) on the device the entry names, records the entry
  (keyed by `options`, those measured with) and returns it. Raises WrongDevice where a candidate ran elsewhere,
  OutOfBudget where time.monotonic() passes `deadline` first: nothing is recorded then."""
  kind, here = target().device_kind, in_process()
  if here and this_device() != kind:
    raise WrongDevice(f"this process runs on {this_device()}, not on {kind} (nothing timed here belongs under {kind})")
  if not here:
    check_parent()
  results, specs, stopped = [], list(specs or specs_for(op, tilings)), None
  for i, spec in enumerate(specs):
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
      stopped = OutOfBudget(f"the budget ran out before {spec}")
    else:
      cap = CHILD_TIMEOUT_S if left is None else min(CHILD_TIMEOUT_S, left)
      try:
        measured = (
          measure_in_process(op, spec, call, options, rounds, cap)
          if here
          else measure(op, spec, call, options, rounds, cap)
        )
      except Hung as why:  # the verdict so far is kept, then the process ends: the restart goes on from it
        results.append(Measured(spec, why=f"timed out: {why} (the process ended)", device=kind))
        _record(kind, op, key, options, results, specs[i + 1 :], f"not measured: {spec} hung the process before it")
        _end_hung(f"{op} {key}: {why}")
      if measured.why and measured.why.startswith("timed out") and cap < CHILD_TIMEOUT_S:
        stopped = OutOfBudget(f"the budget ran out while {spec} ran")
      elif measured.device is not None and measured.device != kind:
        raise WrongDevice(
          f"{spec}'s child process ran on {measured.device}, not on {kind} (a device a child cannot share: a GPU "
          "in exclusive-process mode?)"
        )
    if stopped is not None:  # kept when the reference answered: a restart does not spend its budget here again
      if any(m.name == "xla" and m.device == kind for m in results):
        return _record(kind, op, key, options, results, specs[i:], "not measured: the autotune budget ran out")
      raise stopped
    results.append(measured)
  reference = next((m for m in results if m.name == "xla"), None)
  if reference is not None and reference.device is None:  # XLA never reached the device: no verdict is trusted
    raise NotMeasured(f"XLA's reference never answered on {kind} ({reference.why})")
  return _record(kind, op, key, options, results)


def _record(kind, op, key, options, results, unmeasured=(), why=""):
  """Records (and returns) the entry of `results`, the `unmeasured` candidates dropped with `why`."""
  ran = sorted((m for m in results if m.ms is not None), key=lambda m: m.ms)
  entry = autotune_table.Entry(
    ranking=tuple(m.name for m in ran),
    dropped={m.name: m.why for m in results if m.ms is None} | dict.fromkeys(unmeasured, why),
    ms={m.name: round(m.ms, 4) for m in ran},
  )
  autotune_table.record(kind, op, key, entry, options=options)
  return entry


def _end_hung(what: str) -> None:
  """One line and WATCHDOG_EXIT_CODE, as the watchdog ends a hang: a program that holds the TPU cannot be stopped,
  and the deploy/ recipes restart on this code (the restart reads the verdict recorded before)."""
  from sparsetx.cli import WATCHDOG_EXIT_CODE  # noqa: PLC0415 (kept out of the children's start)

  sys.stderr.write(
    f"error: autotune: {what}; its verdict is recorded and the process ends (a program holding the device cannot be "
    f"stopped). Exiting with code {WATCHDOG_EXIT_CODE}: run the same command again to go on.\n"
  )
  sys.stderr.flush()
  os._exit(WATCHDOG_EXIT_CODE)


def tune_all(todo: dict, options: KernelOptions, report=print, budget_s=None, specs=None, rounds=5, tilings=False):
  """tune() for each call of `todo` ({(op, shape class): call}) within `budget_s` seconds (None: no limit); one line
  per call measured, one for the calls left unmeasured (the budget spent, or the device unreachable) and what
  `auto` takes for them. Returns the entries recorded."""
  deadline = None if budget_s is None else time.monotonic() + budget_s
  entries, left, why_left = {}, [], None
  for (op, key), call in sorted(todo.items()):
    if why_left is not None or (deadline is not None and time.monotonic() >= deadline):
      left.append(f"{op} {key}")
      continue
    report(f"autotune: measuring {op} {key} on {target().device_kind} ({', '.join(specs or specs_for(op, tilings))})")
    try:
      entries[op, key] = tune(op, key, call, options, specs, rounds, tilings, deadline=deadline)
    except OutOfBudget:
      left.append(f"{op} {key}")
      continue
    except NotMeasured as why:  # another device, or no reference: nothing trusted is measured on this host
      why_left = str(why)
      left.append(f"{op} {key}")
      continue
    report(f"autotune: {op} {key}: {describe(entries[op, key])}")
  if left:
    why_left = why_left or f"the budget of {budget_s:g} s is spent"
    report(
      f"autotune: {why_left}; not measured: {'; '.join(left)}: auto takes the default order for them (or an entry "
      "measured at a nearby token count); sparsetx-autotune on the device measures them"
    )
  return entries


def held(calls: dict, options: KernelOptions) -> dict:
  """{(op, shape class): entry} of the calls this device's table holds for these kernel options."""
  kind = target().device_kind
  found = {call: autotune_table.lookup(kind, *call, options=options) for call in calls}
  return {call: entry for call, entry in found.items() if entry is not None}


def missing(calls: dict, options: KernelOptions) -> dict:
  """The calls this device's table lacks for these kernel options. An entry held with nothing usable is not
  measured again on every start (it would cost the same minutes and likely fail the same way): `auto` takes the
  default order for it, and sparsetx-autotune --again measures it anew."""
  there = held(calls, options)
  return {call: found for call, found in calls.items() if call not in there}


def summary(calls: dict, todo: dict, options: KernelOptions, again: bool = False) -> str:
  """One line: how many op shapes the step makes, how many are measured, and what held entries are kept (with
  `again` the table is not read: it may be one only writing will tell about)."""
  if again:
    return f"{len(calls)} op shapes in the step, {len(todo)} to measure (all, --again)"
  unusable = sum(not entry.usable for entry in held(calls, options).values())
  return (
    f"{len(calls)} op shapes in the step, {len(todo)} to measure (those the table lacks; {unusable} held with nothing "
    "usable kept, auto takes the default order for them, --again measures them anew)"
  )


def describe(entry) -> str:
  ran = ", ".join(f"{name} {entry.ms[name]:.3f} ms" for name in entry.ranking) or "none ran"
  dropped = "; ".join(f"{name}: {why}" for name, why in entry.dropped.items())
  return f"chose {entry.ranking[0] if entry.ranking else 'nothing'} ({ran})" + (
    f"; dropped {dropped}" if dropped else ""
  )


def child_main(request: str) -> None:
  """The child's side of `measure`: one candidate, its result (and the device it ran on) on one line."""
  asked = json.loads(request)
  options = KernelOptions(**asked["options"])
  result = measure_here(asked["op"], asked["spec"], asked["call"], options, asked["rounds"])
  print(RESULT_MARK + json.dumps(dataclasses.asdict(result)), flush=True)


if __name__ == "__main__":
  child_main(sys.argv[1])

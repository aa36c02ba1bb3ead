"""The device chooses its kernels: for each kernel op and shape class a step runs, every implementation that lowers
here is timed, its values checked against XLA's on the same inputs, and the fastest correct one is kept in the
autotune table (kernels/autotune_table.py) with the reason each other one was dropped.

Each candidate runs in a child process (`python -m sparsetx.train.autotune JSON`): a kernel that faults (an
illegal instruction poisons the process's CUDA context) takes only its own process down, and is dropped as
faulted. A candidate is a registry name, or `module:attribute` naming a RowKernels or grouped-matmul object
(the tests' fakes).

More: docs/modules.md, sparsetx/train/autotune.py.
"""

import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from sparsetx.config import ConfigError
from sparsetx.kernels import autotune_table, registry
from sparsetx.kernels.device import target
from sparsetx.kernels.fff.tree_route import WALK_ROWS_PER_CHUNK
from sparsetx.kernels.grouped_matmul import op as grouped_op
from sparsetx.kernels.options import KernelOptions, options_from_config
from sparsetx.kernels.rows.gated_gather import gated_gather
from sparsetx.kernels.rows.reference import ACTIVATIONS, Gating
from sparsetx.perf import timing

PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
RESULT_MARK = "autotune result: "
CHILD_TIMEOUT_S = 300
U32 = 2.0**-24
REASSOCIATION = 4  # another summation order (tree, split-k) is allowed this many float32 roundings per term


@dataclasses.dataclass
class Measured:
  name: str
  ms: float | None = None  # None: dropped
  why: str | None = None


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


def inputs(call: dict) -> tuple:
  """Random operands of the call's shapes and dtypes (the program's arguments, then its constants)."""
  k = jax.random.split(jax.random.key(0), 7)
  dtype = jnp.dtype(call["dtype"])
  if call["form"] == "gather":
    N, D, S, R, table = call["tokens"], call["d_model"], call["slots"], call["rows"], jnp.dtype(call["table_dtype"])
    x = jax.random.normal(k[0], (N, D), dtype)
    w_in, w_out = (jax.random.normal(key, (R, D), table) / D**0.5 for key in k[1:3])
    gates = jax.random.normal(k[3], (N, S), jnp.float32)
    bias = jax.random.normal(k[4], (R,), table) if call["bias"] else None
    rows = jax.random.randint(k[5], (N, S), 0, R).astype(jnp.int32)
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
  rhs = jax.random.normal(k[1], (E, K, N), jnp.float32) / K**0.5
  dout = jax.random.normal(k[2], (S, N), dtype)
  return (lhs, rhs), (jnp.asarray(np.full(E, S // E, np.int32)), dout)


def program(call: dict, implementation, options: KernelOptions, constants: tuple):
  """The jitted call as the step makes it, forward and backward where the step differentiates it: the outputs and
  gradients the check compares."""
  if call["form"] == "gather":
    rows, dy, h = constants
    gating = dict(activation=ACTIVATIONS[call["activation"]], gate_inside_activation=call["gate_inside"])

    def loss(x, w_in, w_out, gates, bias=None):
      y = gated_gather(
        x,
        w_in,
        w_out,
        rows,
        gates,
        bias_R=bias,
        options=options,
        pre_activation=h,
        implementation=implementation,
        **gating,
      )
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    argnums = (0, 1, 2, 3, 4) if call["bias"] else (0, 1, 2, 3)
    return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))
  if call["form"] == "walk":
    levels = call["levels"]
    return jax.jit(lambda x, w, b, node: implementation.walk(options, x, w, b, node, levels, WALK_ROWS_PER_CHUNK))
  sizes, dout = constants

  def grouped_loss(lhs, rhs):
    out = grouped_op.run(implementation, lhs, rhs, sizes, options)
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

  return jax.jit(jax.value_and_grad(grouped_loss, argnums=(0, 1), has_aux=True))


def worst_error(got, want, dtype, n: int) -> float:
  """The largest |got - want| over its bound, across every output: two roundings to `dtype` of values that may
  differ by float32 sums of n terms in another order (REASSOCIATION n u32 of the output's scale); integer outputs
  (a walk's nodes) must be equal."""
  u = float(jnp.finfo(dtype).eps) / 2
  worst = 0.0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    if np.issubdtype(b.dtype, np.integer):
      worst = max(worst, 0.0 if np.array_equal(a, b) else np.inf)
      continue
    a, b = a.astype(np.float64), b.astype(np.float64)
    scale = max(float(np.abs(b).max()), np.finfo(np.float32).tiny)
    bound = 2 * u * np.abs(b) + REASSOCIATION * n * U32 * scale
    worst = max(worst, float(np.max(np.abs(a - b) / bound)))
  return worst


def terms(call: dict, constants: tuple) -> int:
  """The most terms one output sums: a dot's width, a token's slots, the pairs a table row gathers."""
  if call["form"] == "gather":
    return max(call["d_model"], call["slots"], int(np.bincount(np.asarray(constants[0]).reshape(-1)).max()))
  if call["form"] == "walk":
    return call["d_model"]
  return max(call["k"], call["n"], call["rows"] // call["experts"])


def measure_here(op: str, spec: str, call: dict, options: KernelOptions, rounds: int) -> Measured:
  """One candidate in this process: refused, wrong values (outputs or gradients), or its median milliseconds."""
  implementation = candidate(op, spec)
  options = registry.naming(implementation, options)
  try:
    implementation.refuse(target(), options, call)
  except NotImplementedError as why:
    return Measured(spec, why=f"raised: {why}")
  args, constants = inputs(call)
  step = program(call, implementation, options, constants)
  try:
    got = jax.block_until_ready(step(*args))
  except NotImplementedError as why:  # a kernel that does not lower for these operands
    return Measured(spec, why=f"raised: {str(why).splitlines()[0] if str(why) else type(why).__name__}")
  reference = registry.by_name(op, "xla")
  want = program(call, reference, registry.naming(reference, options), constants)(*args)
  error = worst_error(got, want, jnp.dtype(call["dtype"]), terms(call, constants))
  if not error <= 1.0:
    return Measured(spec, why=f"wrong values: {error:.3g} times the bound against XLA's")
  return Measured(spec, ms=1e3 * timing.interleaved({spec: lambda: step(*args)}, rounds, warm=False)[spec])


def measure(op: str, spec: str, call: dict, options: KernelOptions, rounds: int) -> Measured:
  """One candidate in a child process; one that dies (a signal, an exit) is dropped as faulted, one that does not
  answer in CHILD_TIMEOUT_S as timed out."""
  request = json.dumps(dict(op=op, spec=spec, call=call, options=options._asdict(), rounds=rounds))
  try:
    result = subprocess.run(
      [sys.executable, "-m", "sparsetx.train.autotune", request],
      capture_output=True,
      text=True,
      timeout=CHILD_TIMEOUT_S,
    )
  except subprocess.TimeoutExpired:
    return Measured(spec, why=f"timed out: no answer in {CHILD_TIMEOUT_S} s")
  for line in reversed(result.stdout.splitlines()):
    if line.startswith(RESULT_MARK):
      return Measured(**json.loads(line[len(RESULT_MARK) :]))
  code = result.returncode
  how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
  last = (result.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
  return Measured(spec, why=f"faulted: {how}: {last[:200]}")


def leave_device_memory_to_children() -> None:
  """Called by a program before JAX starts when it may measure kernels: its own client then allocates as used,
  not 75% of the GPU up front, so each candidate's child process finds the memory it needs."""
  os.environ.setdefault(PREALLOCATE, "false")


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


def tune(op: str, key: str, call: dict, options: KernelOptions, specs=None, rounds: int = 5, tilings: bool = False):
  """Measures every candidate (default: specs_for(op, tilings)), records the table entry for this device and
  returns it."""
  check_parent()
  results = [measure(op, spec, call, options, rounds) for spec in (specs or specs_for(op, tilings))]
  ran = sorted((m for m in results if m.ms is not None), key=lambda m: m.ms)
  entry = autotune_table.Entry(
    ranking=tuple(m.name for m in ran),
    dropped={m.name: m.why for m in results if m.ms is None},
    ms={m.name: round(m.ms, 4) for m in ran},
  )
  autotune_table.record(target().device_kind, op, key, entry)
  return entry


def step_calls(config, built) -> dict:
  """{(op, shape class): call} of every kernel op call the config's train step makes, from one trace of the step
  alone (the model's init, one sequence, is traced by state.setup before), and only calls the autotuner can make
  again."""
  from sparsetx.parallel import logical_rules  # noqa: PLC0415 (the trainer's modules import this one)
  from sparsetx.train import aot, step  # noqa: PLC0415

  with logical_rules.activate(built.mesh, config.mesh.rules):
    jitted = step.make_train_step(config, built)
    with registry.recording() as calls:
      jitted.trace(built.abstract_state, aot.abstract_batch(config, built.batch_sharding))
  return {found: call for found, call in calls.items() if call is not None and measurable(call)}


def missing(calls: dict) -> dict:
  """The calls this device's table lacks, or holds with nothing usable (measured again)."""
  kind = target().device_kind
  return {
    (op, key): call
    for (op, key), call in calls.items()
    if (entry := autotune_table.lookup(kind, op, key)) is None or not entry.usable
  }


def ensure_tuned(config, built, report=print) -> dict:
  """Before a step compiles on a GPU or TPU under `auto`: measures the calls the table lacks. Nothing on a CPU
  (what it runs is XLA's), nothing when the config names its kernels."""
  kernel = config.model.ffn.kernel
  if target().platform == "cpu" or kernel.implementation != "auto":
    return {}
  todo = missing(step_calls(config, built))
  if todo:
    ready_to_measure()
  entries = {}
  for (op, key), call in todo.items():
    report(f"autotune: measuring {op} {key} on {target().device_kind} ({', '.join(specs_for(op))})")
    entries[op, key] = tune(op, key, call, options_from_config(kernel))
    report(f"autotune: {op} {key}: {describe(entries[op, key])}")
  return entries


def describe(entry) -> str:
  ran = ", ".join(f"{name} {entry.ms[name]:.3f} ms" for name in entry.ranking) or "none ran"
  dropped = "; ".join(f"{name}: {why}" for name, why in entry.dropped.items())
  return f"chose {entry.ranking[0] if entry.ranking else 'nothing'} ({ran})" + (
    f"; dropped {dropped}" if dropped else ""
  )


def child_main(request: str) -> None:
  """The child's side of `measure`: one candidate, its result on one line."""
  asked = json.loads(request)
  options = KernelOptions(**asked["options"])
  result = measure_here(asked["op"], asked["spec"], asked["call"], options, asked["rounds"])
  print(RESULT_MARK + json.dumps(dataclasses.asdict(result)), flush=True)


if __name__ == "__main__":
  child_main(sys.argv[1])

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
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from sparsetx.kernels import autotune_table, registry
from sparsetx.kernels.device import target
from sparsetx.kernels.gated_gather import gated_gather
from sparsetx.kernels.options import KernelOptions, options_from_config
from sparsetx.kernels.reference import identity
from sparsetx.perf import timing

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
  tiling, backend.Tiled)."""
  if ":" not in spec:
    return registry.by_name(op, spec)
  spec, _, tiling = spec.partition("@")
  module, _, attribute = spec.partition(":")
  implementation = getattr(importlib.import_module(module), attribute)
  return registry.at_tiling(op, implementation, tiling) if tiling else implementation


def options_for(implementation, base: KernelOptions) -> KernelOptions:
  """The options that ask for `implementation` by name (its config knobs taken from `base`; a tiling's come from
  the implementation itself)."""
  named = getattr(implementation, "base", implementation)
  if named.name == "xla":
    return base._replace(implementation="xla")
  gpu_kernel = named.name if getattr(named, "platform", None) == "gpu" else base.gpu_kernel
  return base._replace(implementation="pallas", gpu_kernel=gpu_kernel)


def inputs(op: str, call: dict, dtype) -> tuple:
  """Random operands of the call's shapes in `dtype` (the parameters float32, as the layers keep them)."""
  k = jax.random.split(jax.random.key(0), 6)
  if op == "rows":
    N, D, S, R = call["tokens"], call["d_model"], call["slots"], call["rows"]
    return (
      jax.random.normal(k[0], (N, D), dtype),
      jax.random.normal(k[1], (R, D), jnp.float32) / D**0.5,
      jax.random.normal(k[2], (R, D), jnp.float32) / D**0.5,
      jax.random.randint(k[3], (N, S), 0, R).astype(jnp.int32),
      jax.random.normal(k[4], (N, S), jnp.float32),
      jax.random.normal(k[5], (N, D), dtype),
    )
  S, K, N, E = call["rows"], call["k"], call["n"], call["experts"]
  sizes = np.full(E, S // E, np.int32)
  return (
    jax.random.normal(k[0], (S, K), dtype),
    jax.random.normal(k[1], (E, K, N), jnp.float32) / K**0.5,
    jnp.asarray(sizes),
    jax.random.normal(k[2], (S, N), dtype),
  )


def program(op: str, implementation, options: KernelOptions):
  """The jitted forward and backward of one call: (outputs, gradients) the check compares."""
  if op == "rows":

    def loss(x, w_in, w_out, gates, rows, dy):
      y = gated_gather(x, w_in, w_out, rows, gates, identity, options=options, implementation=implementation)
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    return jax.jit(lambda x, w_in, w_out, rows, gates, dy: grads(x, w_in, w_out, gates, rows, dy))

  def grouped_loss(lhs, rhs, sizes, dout):
    out = implementation(lhs, rhs, sizes, options)
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

  grouped = jax.value_and_grad(grouped_loss, argnums=(0, 1), has_aux=True)
  return jax.jit(grouped)


def worst_error(got, want, dtype, n: int) -> float:
  """The largest |got - want| over its bound, across every output: two roundings to `dtype` of values that may
  differ by float32 sums of n terms in another order (REASSOCIATION n u32 of the output's scale)."""
  u = float(jnp.finfo(dtype).eps) / 2
  worst = 0.0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.abs(b).max()), np.finfo(np.float32).tiny)
    bound = 2 * u * np.abs(b) + REASSOCIATION * n * U32 * scale
    worst = max(worst, float(np.max(np.abs(a - b) / bound)))
  return worst


def measure_here(op: str, spec: str, call: dict, options: KernelOptions, rounds: int) -> Measured:
  """One candidate in this process: refused, wrong values, or its median milliseconds."""
  implementation = candidate(op, spec)
  options = options_for(implementation, options)
  try:
    implementation.refuse(target(), options, call)
  except NotImplementedError as why:
    return Measured(spec, why=f"raised: {why}")
  dtype = jnp.dtype(call["dtype"])
  args = inputs(op, call, dtype)
  step = program(op, implementation, options)
  try:
    got = jax.block_until_ready(step(*args))
  except NotImplementedError as why:  # a kernel that does not lower for these operands
    return Measured(spec, why=f"raised: {str(why).splitlines()[0] if str(why) else type(why).__name__}")
  reference = registry.by_name(op, "xla")
  want = program(op, reference, options_for(reference, options))(*args)
  n = max(call.get("d_model", 0), call.get("slots", 0), call.get("k", 0), call.get("n", 0), 1)
  if op == "rows":  # a table row sums the pairs that pick it
    n = max(n, int(np.bincount(np.asarray(args[3]).reshape(-1)).max()))
  else:
    n = max(n, call["rows"] // call["experts"])
  error = worst_error(got, want, dtype, n)
  if not error <= 1.0:
    return Measured(spec, why=f"wrong values: {error:.3g} times the bound against XLA's")
  return Measured(spec, ms=1e3 * timing.interleaved({spec: lambda: step(*args)}, rounds, warm=False)[spec])


def measure(op: str, spec: str, call: dict, options: KernelOptions, rounds: int) -> Measured:
  """One candidate in a child process; one that dies (a signal, an exit) or hangs is dropped, saying how."""
  request = json.dumps(dict(op=op, spec=spec, call=call, options=options._asdict(), rounds=rounds))
  try:
    result = subprocess.run(
      [sys.executable, "-m", "sparsetx.train.autotune", request],
      capture_output=True,
      text=True,
      timeout=CHILD_TIMEOUT_S,
    )
  except subprocess.TimeoutExpired:
    return Measured(spec, why=f"faulted: no answer in {CHILD_TIMEOUT_S} s")
  for line in reversed(result.stdout.splitlines()):
    if line.startswith(RESULT_MARK):
      return Measured(**json.loads(line[len(RESULT_MARK) :]))
  code = result.returncode
  how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
  last = (result.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
  return Measured(spec, why=f"faulted: {how}: {last[:200]}")


def specs_for(op: str, tilings: bool = False) -> list:
  """The registry's implementations of `op` that this device runs (XLA always), and with `tilings` each one's
  offered tilings (registry.TRITON_TILINGS, MOSAIC_TILINGS) beside the config's."""
  specs = []
  for i in registry.accepting(op, lambda implementation: options_for(implementation, KernelOptions())):
    specs += [i.name] + [registry.tiling_spec(i, tiling) for tiling in (getattr(i, "tilings", ()) if tilings else ())]
  return specs


def tune(op: str, key: str, call: dict, options: KernelOptions, specs=None, rounds: int = 5, tilings: bool = False):
  """Measures every candidate (default: specs_for(op, tilings)), records the table entry for this device and
  returns it."""
  results = [measure(op, spec, call, options, rounds) for spec in (specs or specs_for(op, tilings))]
  ran = sorted((m for m in results if m.ms is not None), key=lambda m: m.ms)
  entry = autotune_table.Entry(
    ranking=tuple(m.name for m in ran),
    dropped={m.name: m.why for m in results if m.ms is None},
    ms={m.name: round(m.ms, 4) for m in ran},
  )
  autotune_table.record(target().device_kind, op, key, entry)
  return entry


def step_calls(config, mesh) -> dict:
  """{(op, shape class): call} of every kernel op the config's train step resolves, from one trace of it."""
  from sparsetx.parallel import logical_rules  # noqa: PLC0415 (the trainer's modules import this one)
  from sparsetx.train import aot  # noqa: PLC0415

  with registry.recording() as calls, logical_rules.activate(mesh, config.mesh.rules):
    aot.trace_train_step(config, mesh)
  return {found: call for found, call in calls.items() if call is not None}


def missing(calls: dict) -> dict:
  """The calls whose shape class this device's table lacks."""
  kind = target().device_kind
  return {(op, key): call for (op, key), call in calls.items() if autotune_table.lookup(kind, op, key) is None}


def ensure_tuned(config, mesh, report=print) -> dict:
  """Before a step compiles on a GPU or TPU under `auto`: measures the ops whose shapes the table lacks. Nothing on
  a CPU (XLA is its only implementation), nothing when the config names its kernels."""
  kernel = config.model.ffn.kernel
  if target().platform == "cpu" or kernel.implementation != "auto" or kernel.gpu_kernel != "auto":
    return {}
  entries = {}
  for (op, key), call in missing(step_calls(config, mesh)).items():
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

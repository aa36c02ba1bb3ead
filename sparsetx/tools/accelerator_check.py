"""The accelerator acceptance check: on one GPU or TPU, in a few minutes, one table that says the sparse path works.

More: docs/modules.md, sparsetx/tools/accelerator_check.py.
"""

import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from sparsetx import cli, hardware
from sparsetx.kernels import registry
from sparsetx.kernels.device import target
from sparsetx.kernels.grouped_matmul.op import grouped_matmul
from sparsetx.kernels.rows import row_gather, segment_grads
from sparsetx.kernels.rows.gated_gather import KernelOptions, gated_gather
from sparsetx.measure import kernel_bench, step_bench
from sparsetx.perf import timing
from sparsetx.tools import bench_layers

U32 = 2.0**-24  # float32 unit roundoff
REASSOCIATION = 4  # a device may sum in another order (tree, split-k): the bound's allowance for it
TRAIN_TYPES = ["mlp", "sgatlin", "fff", "moe"]
CHILD_TIMEOUT_S = 240
ROWS_MARK = "accelerator check rows: "  # the line a child process prints its rows on, as JSON


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    small=flags.DEFINE_bool("small", False, "Tiny shapes, kernels in interpret mode: the CPU form CI runs."),
    isolate=flags.DEFINE_list(
      "isolate",
      None,
      "Sections to run each in a child process (e.g. 'backend triton,train moe'); by default those that may run a "
      "Mosaic GPU kernel on this GPU.",
    ),
    section=flags.DEFINE_string("section", None, "Run one section and print its rows as JSON (the child's form)."),
  )


def section_names(small) -> list:
  """The check's sections in the order they run: each backend's kernels (Triton first), MoE's bench, one train
  step per type."""
  backends = sorted(kernel_bench.backends(small), key=lambda backend: backend[0] != "triton")
  return [f"backend {name}" for name, _ in backends] + ["moe bench"] + [f"train {name}" for name in TRAIN_TYPES]


def may_run_mosaic_gpu(section: str) -> bool:
  """Whether a section may run a Mosaic GPU kernel on this GPU, under any autotune table: such a fault (segment_sums
  stopped with an illegal instruction under jax 0.11.2) poisons the process's CUDA context, and every later row
  would fail with it. A sparse type's train step runs what `auto` picks, which a table may rank Mosaic GPU first."""
  if target().platform != "gpu":
    return False
  takes = {op: "mosaic" in {i.name for i in registry.runs_here(op)} for op in registry.OPS}
  kind, _, name = section.partition(" ")
  if kind == "backend":
    return name.partition("@")[0] == "mosaic"
  if section in ("moe bench", "train moe"):
    return takes["grouped_matmul"]
  return kind == "train" and name in ("sgatlin", "fff") and takes["rows"]


def section_rows(section: str, small: bool) -> list:
  """One section's rows, each part guarded: a failure is its FAILED row and the rest of the section still runs."""
  kind, _, name = section.partition(" ")
  if kind == "backend":
    options = dict(kernel_bench.backends(small))[name]
    rows = check_kernels(name, options, small)
    if name in {implementation.name for implementation in registry.GROUPED}:
      rows += guarded("kernels", f"{name} grouped matmul + grads", check_grouped, name, options, small)
    return rows + bench_rows(name, options, small)
  if section == "moe bench":
    return guarded("moe bench", "grouped matmul against swiglu", moe_bench_rows, small)
  if kind == "train" and name in TRAIN_TYPES:
    return guarded("train step", name, train_rows, small, name)
  raise ValueError(f"--section={section!r} is no section of the check; use one of {section_names(small)}.")


def child_command(section: str, small: bool) -> list:
  return [sys.executable, "-m", "sparsetx.tools.accelerator_check", f"--section={section}", f"--small={small}"]


def child_rows(section: str, small: bool) -> list:
  """A section's rows from a child process, or one FAILED row saying how the child ended (a signal, an exit code, no
  answer in CHILD_TIMEOUT_S) with its last line of stderr: a kernel that faults takes only its own process down."""
  check = {"backend": "kernels", "moe": "moe bench", "train": "train step"}[section.split()[0]]
  try:
    result = subprocess.run(child_command(section, small), capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    return [(check, section, f"child process: no answer in {CHILD_TIMEOUT_S} s", False)]
  for line in reversed(result.stdout.splitlines()):
    if line.startswith(ROWS_MARK):
      return [tuple(row) for row in json.loads(line[len(ROWS_MARK) :])]
  code = result.returncode
  how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
  last = (result.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
  return [(check, section, f"child process {how}: {last[:120]}", False)]


def all_rows(small: bool, isolate=None) -> list:
  """Every section's rows in order; the `isolate` sections (default: may_run_mosaic_gpu) each in a child process."""
  isolated = may_run_mosaic_gpu if isolate is None else lambda section: section in isolate
  rows = []
  for section in section_names(small):
    rows += child_rows(section, small) if isolated(section) else section_rows(section, small)
  return rows


def kernel_case(small: bool):
  """Ragged shapes (no dimension a multiple of a block): N tokens, S slots, R rows, D = a multiple of 128."""
  N, S, R, D = (37, 5, 23, 128) if small else (1000, 96, 3000, 384)
  k = jax.random.split(jax.random.key(1), 4)
  lhs = jax.random.normal(k[0], (N, D), jnp.float32)
  table = jax.random.normal(k[1], (R, D), jnp.float32)
  rows_NS = jax.random.randint(k[2], (N, S), 0, R).at[:, 0].set(0)  # row 0 is picked by every token
  coef_NS = jax.random.normal(k[3], (N, S), jnp.float32)
  return lhs, table, rows_NS, coef_NS


def within_bound(got, want, scale, n) -> tuple:
  """(max |got - want| / bound, passed) with bound = n * U32 * scale * REASSOCIATION (+ a float32 ulp of want),
  elementwise: `n` is each element's own summation length (an array broadcast against `want`, or one number)."""
  bound = REASSOCIATION * n * U32 * scale + np.abs(want) * U32 + np.finfo(np.float32).tiny
  ratio = float(np.max(np.abs(np.asarray(got, np.float64) - want) / bound))
  return ratio, ratio <= 1.0


def coefficient_matrix(rows_NS, coef_NS, n_rows) -> np.ndarray:
  """[N, R] float64: entry (t, r) sums coef[t, s] over the slots s of token t that pick row r. Every float64
  reference below is one matrix product with it (BLAS on the host), never a per-pair loop or a gathered [N, S, D]."""
  N, S = rows_NS.shape
  flat = (np.arange(N)[:, None] * n_rows + rows_NS).reshape(-1)
  return np.bincount(flat, np.asarray(coef_NS, np.float64).reshape(-1), N * n_rows).reshape(N, n_rows)


def check_kernels(name, options, small) -> list:
  """Rows (check, what, value, verdict) for one backend's three row kernels and the whole op; each runs guarded."""
  lhs, table, rows_NS, coef_NS = kernel_case(small)
  backend = registry.by_name("rows", name)
  x64, t64, c64 = (np.asarray(a, np.float64) for a in (lhs, table, coef_NS))
  r = np.asarray(rows_NS)
  N, S = r.shape
  R, D = table.shape
  coefs_NR, abs_coefs_NR = coefficient_matrix(r, c64, R), coefficient_matrix(r, np.abs(c64), R)
  pairs_R = np.bincount(r.reshape(-1), minlength=R)  # each row's own sum length, not the hottest row's

  def row_dots():
    dots = jax.jit(lambda *a: row_gather.dots(backend, *a, options))(lhs, table, rows_NS)
    want = np.take_along_axis(x64 @ t64.T, r, axis=1)
    scale = np.take_along_axis(np.abs(x64) @ np.abs(t64).T, r, axis=1)
    return within_bound(dots, want, scale, D)

  def row_accumulate():
    acc = jax.jit(lambda *a: row_gather.accumulate(backend, *a, jnp.float32, options))(coef_NS, table, rows_NS)
    return within_bound(acc, coefs_NR @ t64, abs_coefs_NR @ np.abs(t64), S)

  def segment_sums():
    order_P, sorted_rows_P = segment_grads.sort_pairs(rows_NS.reshape(-1), R)
    starts = segment_grads.row_starts(sorted_rows_P, R)
    tokens_P, coefs_P = order_P // S, coef_NS.reshape(-1)[order_P]
    sums, coef_sums = jax.jit(lambda *a: backend.segment_sums(*a, options, with_coef_sums=True))(
      lhs, tokens_P, coefs_P, starts
    )
    ratio, ok = within_bound(sums, coefs_NR.T @ x64, abs_coefs_NR.T @ np.abs(x64), pairs_R[:, None])
    ratio_c, ok_c = within_bound(coef_sums, coefs_NR.sum(0), abs_coefs_NR.sum(0), pairs_R)
    return max(ratio, ratio_c), ok and ok_c

  checks = [
    ("row_dots", row_dots),
    ("row_accumulate", row_accumulate),
    ("segment_sums", segment_sums),
    ("gated gather + grads", lambda: _op_versus_xla(backend, options, lhs, table, rows_NS, coef_NS)),
  ]
  rows = []
  for kernel, check in checks:
    rows += guarded("kernels", f"{name} {kernel}", kernel_row, f"{name} {kernel}", check)
  return rows


def kernel_row(what, check) -> list:
  ratio, ok = check()
  return [("kernels", what, f"err/bound {ratio:.3f}", ok)]


def guarded(check: str, what: str, measure, *args) -> list:
  """measure(*args)'s rows, or one FAILED row with the error's first line: a backend or section that raises (a kernel
  that does not lower, a compile that fails) is reported and the other rows still run."""
  try:
    return measure(*args)
  except Exception as error:  # any failure of a device program is a verdict, not a crash
    lines = str(error).strip().splitlines()
    return [(check, what, f"{type(error).__name__}: {lines[0] if lines else ''}", False)]


def _op_versus_xla(backend, options, lhs, table, rows_NS, gates_NS) -> tuple:
  """The op's value and gradients (x, both tables, gates) against the XLA path, both float32 at highest precision.

  Each element is a float32 sum of n terms that are themselves sums of at most n (n: that element's own lengths,
  the larger of D and the slots S for x and the gates, of D and its row's pairs for a table row), so two float32
  evaluations differ by at most about 2 n u sum|terms|; with sum|terms| taken as at most n times the output's
  largest magnitude (terms of one scale, as these random inputs give), the allowance is 2 n^2 u max|output|,
  times the reassociation factor.
  """
  dy = jnp.cos(lhs)

  def loss(x, w_in, w_out, gates, o, implementation):
    y = gated_gather(
      x[None], w_in, w_out, rows_NS[None], gates[None], jax.nn.gelu, options=o, implementation=implementation
    )[0]
    return jnp.sum(y * dy)

  with jax.default_matmul_precision("highest"):
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), static_argnums=(4, 5))
    got = grad(lhs, table, table, gates_NS, options, backend)
    want = grad(lhs, table, table, gates_NS, KernelOptions("xla", row_sorted=False), None)
  D, S = lhs.shape[1], rows_NS.shape[1]
  pairs_R = np.bincount(np.asarray(rows_NS).reshape(-1), minlength=table.shape[0])
  table_n = np.maximum(pairs_R, D)[:, None]
  lengths = [max(D, S), max(D, S), table_n, table_n, max(D, S)]  # loss, x, w_in, w_out, gates
  worst = 0.0
  for a, b, n in zip(jax.tree.leaves(got), jax.tree.leaves(want), lengths):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.abs(b).max()), np.finfo(np.float32).tiny)
    worst = max(worst, float(np.max(np.abs(a - b) / (2 * REASSOCIATION * n * n * U32 * scale))))
  return worst, worst <= 1.0


def check_grouped(name, options, small) -> list:
  """A row for MoE's grouped matmul on one backend: bf16 rows, float32 weights read as bf16, uneven groups with an
  empty one, padding rows at the end. Each output is a float32 sum (n terms: K, N, or the group's rows) rounded
  once to bf16 (half an ulp: 2^-8 relative)."""
  S, K, N, E = (200, 64, 128, 5) if small else (8192, 1024, 2048, 16)
  k = jax.random.split(jax.random.key(2), 4)
  cuts = np.sort(np.asarray(jax.random.randint(k[3], (E - 1,), 0, S - S // 8)))
  sizes = np.diff(np.concatenate([[0], cuts, [S - S // 8]])).astype(np.int32)
  sizes[1] += sizes[0]
  sizes[0] = 0  # an empty group; the last S // 8 rows are padding
  lhs = jax.random.normal(k[0], (S, K), jnp.float32).astype(jnp.bfloat16)
  rhs = jax.random.normal(k[1], (E, K, N), jnp.float32)
  dout = jax.random.normal(k[2], (S, N), jnp.float32).astype(jnp.bfloat16)

  def grouped(x, w):
    return grouped_matmul(x, w, jnp.asarray(sizes), options)

  def loss(x, w):
    return jnp.sum(grouped(x, w).astype(jnp.float32) * dout.astype(jnp.float32))

  out = jax.jit(grouped)(lhs, rhs)
  dlhs, drhs = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
  ends = np.cumsum(sizes)
  groups = [slice(end - size, end) for size, end in zip(sizes, ends)]  # each expert's rows, in order
  l64, d64 = (np.asarray(a, np.float64) for a in (lhs, dout))
  r64 = np.asarray(rhs.astype(jnp.bfloat16), np.float64)
  routed = int(ends[-1])
  worst = 0.0
  for got, want, n in (  # one float64 matrix product per expert (BLAS), never a gathered [S, K, N]
    (out[:routed], np.concatenate([l64[g] @ r64[e] for e, g in enumerate(groups)]), K),
    (dlhs[:routed], np.concatenate([d64[g] @ r64[e].T for e, g in enumerate(groups)]), N),
    (drhs, np.stack([l64[g].T @ d64[g] for g in groups]), sizes.max()),
  ):
    magnitude = np.abs(want).max()
    bound = REASSOCIATION * n * U32 * n * magnitude + 2.0**-8 * np.abs(want) + np.finfo(np.float32).tiny
    worst = max(worst, float(np.max(np.abs(np.asarray(got, np.float64) - want) / bound)))
  padding_zero = not np.any(np.asarray(out[routed:], np.float64)) and not np.any(np.asarray(drhs[0], np.float64))
  return [("kernels", f"{name} grouped matmul + grads", f"err/bound {worst:.3f}", worst <= 1.0 and padding_zero)]


def moe_bench_rows(small) -> list:
  """MoE's layer forward + backward by grouped matmuls and rolled out, and a SwiGLU of the same active FLOPs."""
  d_model, tokens = (64, 512) if small else (256, 16384)
  moe = dict(type="moe", d_ffw=d_model, n_experts=16, experts_per_token=2)
  moe_cfg, rollout_cfg = (
    bench_layers.layer_config(d_model, "bfloat16", reference, **moe) for reference in (False, True)
  )
  swiglu_cfg = bench_layers.layer_config(d_model, "bfloat16", type="swiglu", d_ffw=2 * d_model)
  variants = [
    bench_layers.Variant("swiglu", bench_layers.SwiGlu(swiglu_cfg), d_model, tokens, "bfloat16"),
    bench_layers.Variant("grouped", bench_layers.moe.Moe(moe_cfg), d_model, tokens, "bfloat16"),
    bench_layers.Variant("rolled out", bench_layers.moe.Moe(rollout_cfg), d_model, tokens, "bfloat16"),
  ]
  bench_layers.run_rounds(variants, 1 if small else 5, kinds=("fwd+bwd",))
  swiglu, grouped, rolled = (v.ms("fwd+bwd") for v in variants)
  what = f"moe D={d_model} E=16 k=2 {tokens} tokens fwd+bwd"
  value = f"{grouped:.2f} ms ({grouped / swiglu:.2f}x swiglu, {rolled / grouped:.1f}x faster than rollout)"
  return [("moe bench", what, value, None)]


def bench_rows(name, options, small) -> list:
  """GB/s rows of one backend per shape; a shape the backend fails at gives one FAILED row there."""
  chip = hardware.chip_of(jax.devices()[0].device_kind)
  peak = chip.hbm_bandwidth if chip else None
  rows = []
  # One shape (ladder scale 4, D 512) keeps the check within minutes; bench_kernels times every rung.
  for shape in kernel_bench.SMALL_SHAPES if small else kernel_bench.LADDER_SHAPES[1:2]:
    rows += guarded("kernel bench", f"{name} D={shape[-1]}", backend_bench_rows, name, options, shape, small, peak)
  return rows


def backend_bench_rows(backend, options, shape, small, peak) -> list:
  timings = kernel_bench.kernel_timings(shape, jnp.dtype("bfloat16"), backend, options, 1 if small else 10)
  return [bench_row(backend, *timing, shape, peak) for timing in timings]


def bench_row(backend, kernel, phase, seconds, nbytes, shape, peak) -> tuple:
  rate = nbytes / seconds
  share = f" ({100 * rate / peak:.0f}% of HBM peak)" if peak else ""
  return ("kernel bench", f"{backend} {kernel} {phase} D={shape[-1]}", f"{rate / 1e9:,.1f} GB/s{share}", None)


def train_rows(small, name) -> list:
  args = step_bench.with_defaults(
    SimpleNamespace(
      types=[name],
      scale=None,
      batch=8,
      seq_len=None,
      dtype=None,
      rounds=1 if small else 5,
      small=small,
      peak_tflops=None,
    )
  )
  devices = jax.devices()[:1]
  peak = step_bench.peak_flops(args, devices)
  rows = []
  for step in step_bench.measure(args, devices):
    mfu = f", MFU {step.model_flops / (step.seconds * peak):.1%}" if peak else ""
    what = f"{step.name} scale {args.scale} {args.dtype}"
    rows.append(("train step", what, f"{step.tokens / step.seconds:,.0f} tokens/s{mfu}", None))
  return rows


def format_table(rows) -> str:
  lines = [f"{'check':<14}{'what':<44}{'value':<40}verdict"]
  for check, what, value, verdict in rows:
    mark = "" if verdict is None else ("ok" if verdict else "FAILED")
    lines.append(f"{check:<14}{what:<44}{value:<40}{mark}")
  return "\n".join(lines)


def absl_main(argv, holders: dict):
  del argv
  small = holders["small"].value
  if holders["section"].value:
    print(ROWS_MARK + json.dumps(section_rows(holders["section"].value, small)))
    return
  device = jax.devices()[0]
  with timing.Stopwatch() as clock:
    rows = all_rows(small, holders["isolate"].value)
  print(f"accelerator check on {device.device_kind} (jax {jax.__version__}), {clock.seconds:.0f} s")
  print(format_table(rows))
  if any(verdict is False for *_, verdict in rows):
    sys.exit(1)


def main():
  """The `sparsetx-accelerator-check` entry point."""
  # A child process needs room on the GPU beside this one: allocate as used, not 75% of the memory up front.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()

"""Timing of the sparse layers' kernels on this device: each row kernel alone and the whole gated gather, per backend.

Shared by sparsetx/tools/bench_kernels.py (its table) and sparsetx/tools/accelerator_check.py. Bytes are what each
kernel must move: the rows it gathers in the compute dtype, its token-side operands and its output.
"""

import functools

import jax
import jax.numpy as jnp

from sparsetx.kernels import registry
from sparsetx.kernels.rows import row_gather, segment_grads
from sparsetx.kernels.rows.gated_gather import KernelOptions, gated_gather
from sparsetx.perf import timing

LADDER_SHAPES = [(16384, 16, 8, 40**2, 256), (16384, 16, 8, 64**2, 512), (16384, 16, 8, 112**2, 1024)]
SMALL_SHAPES = [(64, 2, 2, 16**2, 128)]


def backends(small: bool) -> list:
  """(name, KernelOptions) of every row-kernel implementation but XLA's own that this device runs
  (registry.runs_here; with --small also Triton's kernels in interpret mode, the CPU's check of them). Each is timed
  by its name, not resolved from its options."""
  return [
    (i.name, registry.naming(i, KernelOptions(interpret=small)))
    for i in registry.runs_here("rows", interpreted=small)
    if i.name != "xla"
  ]


def case(tokens, n_channels, top_k, d_ffw, d_model, dtype):
  """x [N, D], float32 tables [R, D], rows and gates [N, C*k] (channel-local top-k ids), dy [N, D]."""
  k = jax.random.split(jax.random.key(0), 6)
  n_rows = n_channels * d_ffw
  x = jax.random.normal(k[0], (tokens, d_model), dtype)
  w_in = jax.random.normal(k[1], (n_rows, d_model)) / d_ffw**0.5
  w_out = jax.random.normal(k[2], (n_rows, d_model)) / d_ffw**0.5
  local = jax.random.randint(k[3], (tokens, n_channels, top_k), 0, d_ffw)
  rows = (local + d_ffw * jnp.arange(n_channels)[:, None]).reshape(tokens, -1).astype(jnp.int32)
  gates = jax.random.normal(k[4], rows.shape, jnp.float32)
  dy = jax.random.normal(k[5], (tokens, d_model), dtype)
  return x, w_in, w_out, rows, gates, dy


def kernel_timings(shape, dtype, backend_name, options, repeats) -> list:
  """(kernel, pass, seconds, bytes) for one backend (a registry name) at one shape: each row kernel alone, then the
  whole op."""
  x, w_in, w_out, rows, gates, dy = case(*shape, dtype)
  N, D = x.shape
  S = rows.shape[1]
  R = w_in.shape[0]
  item = dtype.itemsize
  table = w_in.astype(dtype)  # the op streams tables in the compute dtype (gated_gather.py)
  backend = registry.by_name("rows", backend_name)
  order_P, sorted_rows_P = segment_grads.sort_pairs(rows.reshape(-1), R)
  starts_R1 = segment_grads.row_starts(sorted_rows_P, R)
  tokens_P, coefs_P = order_P // S, gates.reshape(-1)[order_P]
  gathered = N * S * D * item  # rows read by one gather pass
  per_slot = N * S * 4  # one [N, S] int32 or float32 array
  kernels = [
    (
      "row_dots",
      "fwd",
      lambda: row_gather.dots(backend, x, table, rows, options),
      gathered + N * D * item + 2 * per_slot,
    ),
    (
      "row_accumulate",
      "fwd",
      lambda: row_gather.accumulate(backend, gates, table, rows, dtype, options),
      gathered + N * D * item + 2 * per_slot,
    ),
    (
      "segment_sums",
      "bwd",
      lambda: backend.segment_sums(x, tokens_P, coefs_P, starts_R1, options),
      gathered + 3 * per_slot + R * D * 4,
    ),
  ]
  calls = {(name, phase): jax.jit(fn) for name, phase, fn, _ in kernels}
  nbytes = {(name, phase): n for name, phase, _, n in kernels}

  def loss(x, w_in, w_out, gates, o, i):
    return (gated_gather(x, w_in, w_out, rows, gates, options=o, implementation=i).astype(jnp.float32) * dy).sum()

  op_forward = 2 * (gathered + N * D * item + 2 * per_slot)
  op_backward = op_forward + 2 * (gathered + 3 * per_slot + R * D * 4)  # both tables' segment sums
  for name, o, i in (("gated gather", options, backend), ("gated gather, xla", KernelOptions("xla"), None)):
    forward = jax.jit(lambda x, wi, wo, g, o=o, i=i: gated_gather(x, wi, wo, rows, g, options=o, implementation=i))
    both = jax.jit(jax.grad(lambda *a, o=o, i=i: loss(*a, o, i), argnums=(0, 1, 2, 3)))
    calls[name, "fwd"] = functools.partial(forward, x, w_in, w_out, gates)
    calls[name, "fwd+bwd"] = functools.partial(both, x, w_in, w_out, gates)
    nbytes[name, "fwd"], nbytes[name, "fwd+bwd"] = op_forward, op_forward + op_backward
  seconds = timing.interleaved(calls, repeats)
  return [(name, phase, seconds[name, phase], nbytes[name, phase]) for name, phase in calls]


def measure(small: bool, dtype: str = "bfloat16", repeats: int = 20) -> list:
  """(shape, backend, kernel, pass, seconds, bytes) rows (the acceptance script reads them too)."""
  dtype = jnp.dtype(dtype)
  results = []
  for shape in SMALL_SHAPES if small else LADDER_SHAPES:
    for name, options in backends(small):
      try:
        timings = kernel_timings(shape, dtype, name, options, 1 if small else repeats)
      except Exception as error:  # a backend that cannot take this shape (or does not lower) says so; others run
        lines = str(error).strip().splitlines()
        print(f"{shape} {name}: skipped: {type(error).__name__}: {lines[0] if lines else ''}")
        continue
      results += [(shape, name, *row) for row in timings]
  return results

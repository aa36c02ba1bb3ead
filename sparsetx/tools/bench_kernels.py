"""GPU benchmark of the gated-gather kernels: achieved GB/s and TFLOP/s, Pallas next to XLA.

Times the op's forward (and forward+backward) per implementation at sgatlin-like shapes and
prints bandwidth counting the bytes actually gathered (2 * tokens * S rows of D table values,
plus x and y), the fraction of the device's HBM peak, and TFLOP/s (4 * tokens * S * D forward).
Pallas rows: the Mosaic GPU kernels (Hopper and newer) for each --block_d x --stages, and the Triton
lowering for each --block_tokens. Finishes in well under 5 minutes on an H100/H200. On CPU `--small` runs
a smoke check (Pallas in interpret mode), useful only to see the program work.

  .venv/bin/python -m sparsetx.tools.bench_kernels            # on a GPU
  .venv/bin/python -m sparsetx.tools.bench_kernels --small    # anywhere
"""

import statistics
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from absl import flags

from sparsetx import cli
from sparsetx.kernels.gated_gather import KernelOptions, gated_gather, gated_gather_reference

HBM_PEAK_GBS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0, "TPU v5": 2765.0, "TPU v4": 1200.0}

_FLAGS = dict(
  small=flags.DEFINE_bool("small", False, "Tiny shapes (CPU smoke check)."),
  dtype=flags.DEFINE_string("dtype", "bfloat16", "Table and activation dtype."),
  repeats=flags.DEFINE_integer("repeats", 20, "Timed calls per variant (median)."),
  block_tokens=cli.define_integer_list("block_tokens", [8, 16], "triton: tokens per program."),
  block_d=cli.define_integer_list("block_d", [128, 256], "mosaic: d_model chunk per row copy."),
  stages=cli.define_integer_list("stages", [2, 3], "mosaic: gathered tiles in flight."),
)


def hbm_peak(kind):
  return next((gbs for name, gbs in HBM_PEAK_GBS.items() if name.lower() in kind.lower()), None)


def case(tokens, n_channels, top_k, d_ffw, d_model, dtype):
  k = jax.random.split(jax.random.key(0), 5)
  rows_total = n_channels * d_ffw
  x = jax.random.normal(k[0], (tokens, d_model), dtype)
  w_in = (jax.random.normal(k[1], (rows_total, d_model)) / d_ffw**0.5).astype(dtype)
  w_out = (jax.random.normal(k[2], (rows_total, d_model)) / d_ffw**0.5).astype(dtype)
  local = jax.random.randint(k[3], (tokens, n_channels, top_k), 0, d_ffw)
  rows = (local + d_ffw * jnp.arange(n_channels)[:, None]).reshape(tokens, -1)
  gates = jax.random.normal(k[4], rows.shape, jnp.float32)
  return x[None], w_in, w_out, rows[None], gates[None]  # one sequence of `tokens` (the op takes [B, T, ...])


def fits_check(options, x, w_in, rows):
  """Raises the kernel's own ValueError when a Mosaic configuration cannot run these shapes."""
  if options.gpu_kernel == "mosaic":
    from sparsetx.kernels import mosaic_gpu

    jax.eval_shape(lambda: mosaic_gpu.row_dots(x[0, :64], w_in, rows[0, :64].T, options))


def timed(fn, args, repeats):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def absl_main(argv):
  del argv
  args = SimpleNamespace(**{name: holder.value for name, holder in _FLAGS.items()})
  dtype = jnp.dtype(args.dtype)
  kind = jax.devices()[0].device_kind
  peak = hbm_peak(kind)
  print(f"jax {jax.__version__} on {kind}; HBM peak {peak or 'unknown'} GB/s")
  if args.small:
    shapes = [(64, 2, 2, 256, 128)]
    args.repeats, args.block_tokens, args.block_d, args.stages = 1, [8], [128], [2]
  else:  # (tokens, C, k, d_ffw, d_model): ladder scales 2, 4, 8
    shapes = [(16384, 16, 8, 40**2, 256), (16384, 16, 8, 64**2, 512), (16384, 16, 8, 112**2, 1024)]
  implementations = (
    [("xla", KernelOptions("xla"))]
    + [
      (f"mosaic d={bd} st={st}", KernelOptions("pallas", gpu_kernel="mosaic", block_d=bd, stages=st))
      for bd in args.block_d
      for st in args.stages
    ]
    + [(f"triton bt={bt}", KernelOptions("pallas", gpu_kernel="triton", block_tokens=bt)) for bt in args.block_tokens]
  )
  print(
    f"{'shape (N,C,k,d_ffw,D)':32s}{'impl':20s}{'fwd ms':>9s}{'GB/s':>9s}{'% HBM':>7s}{'TFLOP/s':>9s}{'f+b ms':>9s}{'x ref f+b':>10s}"
  )
  for shape in shapes:
    tokens, C, K, d_ffw, D = shape
    x, w_in, w_out, rows, gates = case(*shape, dtype)
    gathered = 2 * tokens * C * K * D * dtype.itemsize + 2 * tokens * D * dtype.itemsize
    flops = 4 * tokens * C * K * D
    loss = lambda op: jax.jit(
      jax.grad(lambda x, wi, wo, g: op(x, wi, wo, rows, g).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))
    )
    ref_fb = timed(loss(gated_gather_reference), (x, w_in, w_out, gates), args.repeats)
    for name, options in implementations:
      try:
        fits_check(options, x, w_in, rows)
      except ValueError as error:  # e.g. a block_d x stages ring that does not fit shared memory
        print(f"{str(shape):32s}{name:20s}  skipped: {error}")
        continue
      op = lambda x, wi, wo, r, g, o=options: gated_gather(x, wi, wo, r, g, options=o)
      fwd = timed(jax.jit(op), (x, w_in, w_out, rows, gates), args.repeats)
      fb = timed(loss(op), (x, w_in, w_out, gates), args.repeats)
      gbs = gathered / fwd / 1e9
      pct = f"{100 * gbs / peak:6.1f}%" if peak else "    -"
      print(
        f"{str(shape):32s}{name:20s}{1e3 * fwd:9.2f}{gbs:9.1f}{pct:>7s}{flops / fwd / 1e12:9.2f}{1e3 * fb:9.2f}{ref_fb / fb:10.2f}"
      )


def main():
  """The `sparsetx-bench-kernels` entry point."""
  cli.run(absl_main)


if __name__ == "__main__":
  main()

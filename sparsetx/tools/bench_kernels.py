"""Benchmark of the sparse layers' kernels on this device: ms, GB/s and % of HBM peak per kernel, forward and backward.

At sgatlin shapes (ladder scales 2, 4, 8: 16,384 tokens, C = 16, k = 8) it times each row kernel of each backend
the platform runs (kernels/platform.py: Mosaic GPU and Triton on a GPU, Pallas TPU on a TPU) alone, and the whole
gated gather forward and forward + backward, next to the XLA path. Bandwidth counts the bytes each kernel must
move (the rows it gathers in the table's dtype, its token-side operands and its output), so % of HBM peak is how
close the kernel runs to the memory system (hardware.py's published peak). `--small` runs a tiny shape with the
kernels in interpret mode: it shows the program works anywhere, its times mean nothing.

More: docs/modules.md, sparsetx/tools/bench_kernels.py.
"""

import jax
from absl import flags

from sparsetx import cli, hardware
from sparsetx.measure import kernel_bench


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    small=flags.DEFINE_bool("small", False, "A tiny shape, kernels in interpret mode (a smoke check anywhere)."),
    dtype=flags.DEFINE_string("dtype", "bfloat16", "Table and activation dtype."),
    repeats=flags.DEFINE_integer("repeats", 20, "Timed calls per variant (median)."),
  )


def format_rows(results, peak_bytes_per_s) -> str:
  """One table: shape, backend, kernel, pass, ms, GB/s and % of HBM peak."""
  lines = [f"{'shape (N,C,k,d_ffw,D)':30s}{'backend':9s}{'kernel':20s}{'pass':9s}{'ms':>9s}{'GB/s':>9s}{'% HBM':>8s}"]
  for shape, backend, kernel, phase, seconds, nbytes in results:
    rate = nbytes / seconds
    share = f"{100 * rate / peak_bytes_per_s:7.1f}%" if peak_bytes_per_s else "      -"
    lines.append(f"{str(shape):30s}{backend:9s}{kernel:20s}{phase:9s}{1e3 * seconds:9.3f}{rate / 1e9:9.1f}{share:>8s}")
  return "\n".join(lines)


def hbm_peak() -> float | None:
  """This device's published HBM bandwidth (bytes/s), or None for a chip hardware.py does not hold."""
  chip = hardware.chip_of(jax.devices()[0].device_kind)
  return chip.hbm_bandwidth if chip else None


def absl_main(argv, holders: dict):
  del argv
  args = cli.flag_values(holders)
  peak = hbm_peak()
  print(
    f"jax {jax.__version__} on {jax.devices()[0].device_kind}; HBM peak {f'{peak / 1e9:,.0f} GB/s' if peak else 'unknown'}"
  )
  print(format_rows(kernel_bench.measure(args.small, args.dtype, args.repeats), peak))


def main():
  """The `sparsetx-bench-kernels` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()

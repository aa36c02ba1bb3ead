"""Benchmark the sparse feed-forward layers against the papers' formulations and dense baselines.

More: docs/modules.md, sparsetx/tools/bench_layers.py.
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import flags

from sparsetx import cli
from sparsetx.config import ConfigError, default_config, validate
from sparsetx.kernels import op_calls, registry
from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows import mosaic, row_chunks, segment_grads, tpu, triton
from sparsetx.models.ffn import moe
from sparsetx.models.ffn.common import gini
from sparsetx.models.ffn.dense import Mlp, SwiGlu
from sparsetx.models.ffn.fff import Fff
from sparsetx.models.ffn.sgatlin import Sgatlin
from sparsetx.perf import timing


def layer_config(d_model, dtype, reference=False, **ffn):
  """The model config of one layer; `reference` runs its op in the form the kernels replace (Listing 1's gather
  and einsums for the gated gather, `jax.lax.ragged_dot` for MoE's grouped matmul)."""
  config = default_config()
  config.model.d_model = d_model
  config.model.head_dim = min(64, d_model)
  config.model.dtype = dtype
  config.model.ffn.update(ffn)
  if reference:
    config.model.ffn.kernel.implementation = "reference"
  validate(config)
  return ml_collections.FrozenConfigDict(config.model)


class Variant:
  """A layer, its params and input, compiled forward and forward+backward, with temp bytes."""

  def __init__(self, name, module, d_model, tokens, dtype):
    self.name = name
    x = jax.random.normal(jax.random.key(0), (tokens // 256, 256, d_model), jnp.dtype(dtype))
    params = jax.jit(module.init)(jax.random.key(1), x)
    fwd = jax.jit(lambda p, x: module.apply(p, x))
    loss = lambda p, x: jnp.sum(module.apply(p, x).astype(jnp.float32) ** 2)  # noqa: E731
    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
    self.steps = {"fwd": fwd.lower(params, x).compile(), "fwd+bwd": fwd_bwd.lower(params, x).compile()}
    self.args = (params, x)
    self.temp_mib = {k: c.memory_analysis().temp_size_in_bytes / 2**20 for k, c in self.steps.items()}
    self.seconds = {}  # median seconds per kind, from run_rounds

  def ms(self, kind):
    return 1e3 * self.seconds[kind]


def run_rounds(variants, rounds, kinds=("fwd", "fwd+bwd")):
  """Times the variants' `kinds` side by side (perf/timing.py); each variant's ms() reads its medians."""
  calls = {(v, kind): functools.partial(v.steps[kind], *v.args) for kind in kinds for v in variants}
  for (v, kind), seconds in timing.interleaved(calls, rounds).items():
    v.seconds[kind] = seconds


def print_table(title, variants, baseline, kinds=("fwd", "fwd+bwd")):
  print(f"\n{title}")
  header = (
    f"{'layer':32s}"
    + "".join(f"{k + ' ms':>12s}{'x ' + baseline.name[:10]:>16s}" for k in kinds)
    + f"{'temp MiB':>10s}"
  )
  print(header)
  for v in variants:
    row = f"{v.name:32s}"
    for k in kinds:
      row += f"{v.ms(k):12.1f}{v.ms(k) / baseline.ms(k):16.2f}"
    print(row + f"{max(v.temp_mib.values()):10.0f}")


def rung(scale, tokens, dtype, rounds):
  d = 128 * scale
  mlp_cfg = layer_config(d, dtype, type="mlp", d_ffw=int(8 / 3 * d / 256) * 256)
  sgatlin = dict(type="sgatlin", d_ffw=(16 + 12 * scale) ** 2, n_channels=16, top_k=8, d_key=128)
  sg_cfg, papers_cfg = layer_config(d, dtype, **sgatlin), layer_config(d, dtype, reference=True, **sgatlin)
  variants = [
    Variant("mlp", Mlp(mlp_cfg), d, tokens, dtype),
    Variant("swiglu", SwiGlu(mlp_cfg), d, tokens, dtype),
    Variant("sgatlin (gated gather op)", Sgatlin(sg_cfg), d, tokens, dtype),
    Variant("sgatlin (Listing 1)", Sgatlin(papers_cfg), d, tokens, dtype),
  ]
  run_rounds(variants, rounds)
  print_table(
    f"ladder scale {scale}: d_model={d}, {tokens} tokens, {dtype}; sgatlin d_ffw={(16 + 12 * scale) ** 2}",
    variants,
    variants[0],
  )
  ours, papers = variants[2], variants[3]
  print(
    f"  sgatlin speed-up over Listing 1: fwd {papers.ms('fwd') / ours.ms('fwd'):.2f}x, fwd+bwd {papers.ms('fwd+bwd') / ours.ms('fwd+bwd'):.2f}x"
  )
  return variants


def moe_table(scale, tokens, dtype, rounds, n_experts=16, experts_per_token=2):
  """The ladder's MoE rung (16 experts, top-2, d_ffw = d_model) by grouped matmuls, rolled out, and a SwiGLU of
  k * d_ffw neurons: the same expert FLOPs per token, no router and no dispatch."""
  d = 128 * scale
  moe_kw = dict(type="moe", d_ffw=d, n_experts=n_experts, experts_per_token=experts_per_token)
  moe_cfg, rollout_cfg = layer_config(d, dtype, **moe_kw), layer_config(d, dtype, reference=True, **moe_kw)
  swiglu_cfg = layer_config(d, dtype, type="swiglu", d_ffw=experts_per_token * d)
  variants = [
    Variant(f"swiglu d_ffw={experts_per_token * d}", SwiGlu(swiglu_cfg), d, tokens, dtype),
    Variant("moe (grouped matmuls)", moe.Moe(moe_cfg), d, tokens, dtype),
    Variant("moe (ragged_dot rolled out)", moe.Moe(rollout_cfg), d, tokens, dtype),
  ]
  run_rounds(variants, rounds)
  print_table(
    f"MoE at ladder scale {scale}: d_model={d}, {n_experts} experts of d_ffw={d}, top-{experts_per_token}, {tokens} "
    f"tokens, {dtype}; against a SwiGLU of the same active FLOPs",
    variants,
    variants[0],
  )
  grouped, dense = variants[1], variants[2]
  print(
    f"  grouped speed-up over the rollout: fwd {dense.ms('fwd') / grouped.ms('fwd'):.2f}x, "
    f"fwd+bwd {dense.ms('fwd+bwd') / grouped.ms('fwd+bwd'):.2f}x"
  )
  return variants


def fff_table(depths, tokens, dtype, rounds, d_model=768, n_trees=16):
  rows = []
  for depth in depths:
    cfg = lambda impl: layer_config(d_model, dtype, type="fff", depth=depth, n_trees=n_trees, implementation=impl)
    pair = [
      Variant(f"fff depth {depth} sparse", Fff(cfg("sparse")), d_model, tokens, dtype),
      Variant(f"fff depth {depth} masked-dense", Fff(cfg("masked_dense")), d_model, tokens, dtype),
    ]
    run_rounds(pair, rounds)
    rows.append(pair)
  print(f"\nFFF: d_model={d_model}, {n_trees} trees, {tokens} tokens, {dtype} (ratio = masked-dense / sparse)")
  print(
    f"{'depth':>6s}{'sparse fwd':>12s}{'dense fwd':>12s}{'speed-up':>10s}{'sparse f+b':>12s}{'dense f+b':>12s}{'speed-up':>10s}"
  )
  for depth, (sparse, dense) in zip(depths, rows):
    print(
      f"{depth:6d}{sparse.ms('fwd'):12.1f}{dense.ms('fwd'):12.1f}{dense.ms('fwd') / sparse.ms('fwd'):10.2f}"
      f"{sparse.ms('fwd+bwd'):12.1f}{dense.ms('fwd+bwd'):12.1f}{dense.ms('fwd+bwd') / sparse.ms('fwd+bwd'):10.2f}"
    )
  return rows


def sweep(n_keys_list, scale, tokens, dtype, rounds):
  d = 128 * scale
  variants = [
    Variant(
      f"d_ffw={n}^2",
      Sgatlin(layer_config(d, dtype, type="sgatlin", d_ffw=n * n, n_channels=16, top_k=8, d_key=128)),
      d,
      tokens,
      dtype,
    )
    for n in n_keys_list
  ]
  for v in variants:
    v.steps.pop("fwd+bwd")
  run_rounds(variants, rounds, kinds=("fwd",))
  print(f"\nsgatlin forward vs number of neurons: d_model={d}, C=16, k=8, {tokens} tokens, {dtype}")
  print(f"{'d_ffw':>10s}{'fwd ms':>10s}{'x smallest':>12s}")
  for n, v in zip(n_keys_list, variants):
    print(f"{n * n:10d}{v.ms('fwd'):10.1f}{v.ms('fwd') / variants[0].ms('fwd'):12.2f}")
  return variants


def zipf_exponent(n_rows, target_gini):
  """The exponent a whose row probabilities (i + 1) ** -a over n_rows rows have the target Gini (bisection)."""
  lo, hi = 0.0, 4.0
  for _ in range(50):
    a = (lo + hi) / 2
    lo, hi = (a, hi) if float(gini(jnp.asarray(np.arange(1, n_rows + 1) ** -a))) < target_gini else (lo, a)
  return (lo + hi) / 2


def table_grad_rows(tokens, n_channels, top_k, d_ffw, exponent, seed=0):
  """[tokens, C * k] table rows, channel c's picks in [c * d_ffw, (c + 1) * d_ffw): uniform (exponent 0) or
  Zipf-skewed, each channel's hot rows at their own random ids."""
  rng = np.random.default_rng(seed)
  p = np.arange(1, d_ffw + 1) ** -exponent
  local = np.stack(
    [rng.permutation(d_ffw)[rng.choice(d_ffw, (tokens, top_k), p=p / p.sum())] for _ in range(n_channels)], axis=1
  )
  return jnp.asarray((local + d_ffw * np.arange(n_channels)[:, None]).reshape(tokens, -1), jnp.int32)


def sgatlin_rows(options, tokens, d_model, slots, n_rows, dtype):
  """The row kernels `auto` picks for an sgatlin layer's gated gather of these sizes (identity, float32 tables)."""
  x, table = jax.ShapeDtypeStruct((tokens, d_model), dtype), jax.ShapeDtypeStruct((n_rows, d_model), jnp.float32)
  call = op_calls.gather(x, table, dtype, slots, op_calls.ACTIVATIONS["identity"], True, False, False, False)
  return registry.rows(options, op_calls.shape_class(call), call)


class TableGrads:
  """The table gradients of sgatlin's gated gather (both tables) alone, compiled, for one row distribution."""

  def __init__(self, name, rows, d_model, n_rows, dtype, options):
    self.name = name
    k = jax.random.split(jax.random.key(2), 4)
    tokens = rows.shape[0]
    x, dy = (jax.random.normal(key, (tokens, d_model), jnp.dtype(dtype)) for key in k[:2])
    coef_in, coef_out = (jax.random.normal(key, rows.shape, jnp.float32) for key in k[2:])
    implementation = sgatlin_rows(options, tokens, d_model, rows.shape[1], n_rows, dtype)
    step = lambda *a: segment_grads.table_grads(implementation, *a, n_rows, options, with_bias=False)[:2]  # noqa: E731
    self.args = (x, dy, rows, coef_in, coef_out)
    self.step = jax.jit(step).lower(*self.args).compile()
    self.seconds = None  # median seconds, from table_grads_table

  def ms(self):
    return 1e3 * self.seconds


def table_grads_table(scale, tokens, dtype, rounds, target_gini, chunks, implementation="auto"):
  """sgatlin's table-gradient time with uniform and skewed rows, with whole rows and with rows cut into chunks."""
  d, n_keys, n_channels, top_k = 128 * scale, 16 + 12 * scale, 16, 8
  d_ffw = n_keys**2
  exponent = zipf_exponent(d_ffw, target_gini)
  dists = {"uniform": table_grad_rows(tokens, n_channels, top_k, d_ffw, 0.0)}
  dists["skewed"] = table_grad_rows(tokens, n_channels, top_k, d_ffw, exponent)
  options = KernelOptions(implementation)
  backend = sgatlin_rows(options, tokens, d, n_channels * top_k, n_channels * d_ffw, dtype)
  path = "XLA's scatter-adds: chunks do not apply" if backend.name == "xla" else backend.name
  variants = {
    (dist, chunk): TableGrads(
      f"{dist} chunk {chunk}", rows, d, n_channels * d_ffw, dtype, options._replace(segment_chunk=chunk)
    )
    for dist, rows in dists.items()
    for chunk in chunks
  }
  calls = {v: functools.partial(v.step, *v.args) for v in variants.values()}
  for v, seconds in timing.interleaved(calls, rounds).items():
    v.seconds = seconds
  print(
    f"\nsgatlin table gradients at ladder scale {scale}: d_model={d}, {n_channels} x {d_ffw} rows, top-{top_k}, "
    f"{tokens} tokens, {dtype}, {path}"
  )
  print(
    f"{'rows':>10s}{'gini':>8s}{'max pairs':>11s}"
    + "".join(f"{'chunk ' + str(c) + ' ms':>16s}" for c in chunks)
    + "".join(f"{f'{c} / {chunks[0]}':>12s}" for c in chunks[1:])
  )
  for dist, rows in dists.items():
    counts = jnp.bincount(rows.reshape(-1), length=n_channels * d_ffw).reshape(n_channels, d_ffw)
    times = [variants[dist, c].ms() for c in chunks]
    print(
      f"{dist:>10s}{float(jnp.mean(gini(counts))):8.2f}{int(counts.max()):11d}"
      + "".join(f"{t:16.2f}" for t in times)
      + "".join(f"{t / times[0]:12.2f}" for t in times[1:])
    )
  print("  pairs the busiest program walks in turn (the kernels' critical path; both passes when rows are cut):")
  print(f"{'rows':>10s}{'chunk':>8s}" + "".join(f"{name:>12s}" for name in PROGRAM_SHAPES))
  for dist, rows in dists.items():
    for chunk in chunks:
      walks = critical_walks(rows, n_channels * d_ffw, chunk)
      print(f"{dist:>10s}{chunk:8d}" + "".join(f"{w:12d}" for w in walks))
  return variants


# segment_sums' programs: (segments per program, whether its segments run side by side in lanes)
PROGRAM_SHAPES = {
  "mosaic": (mosaic.BLOCK_ROWS, False),
  "tpu": (tpu.SEGMENT_ROWS, False),
  "triton": (triton.SEGMENT_ROWS, True),
}


def critical_walks(rows_NS, n_rows, chunk):
  """Per backend, the pairs its busiest segment_sums program walks one after another: a block's segments in turn,
  or, where they run in lanes, its longest; cut rows add the combine's busiest program."""
  sorted_rows = jnp.sort(rows_NS.reshape(-1))
  starts = segment_grads.row_starts(sorted_rows, n_rows)
  passes = [starts]
  if row_chunks.tail_segments(sorted_rows.shape[0], chunk):
    plan = jax.jit(row_chunks.plan, static_argnums=2)(sorted_rows, starts, chunk)
    passes = [plan.starts_V1, plan.combine_starts_M1]
  walks = []
  for per_program, lanes in PROGRAM_SHAPES.values():
    total = 0
    for bounds in passes:
      lengths = np.diff(np.asarray(bounds))
      blocks = np.pad(lengths, (0, -len(lengths) % per_program)).reshape(-1, per_program)
      total += int((blocks.max(1) if lanes else blocks.sum(1)).max())
    walks.append(total)
  return walks


def plot(path, rungs, fff_rows, sweep_variants, n_keys_list):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  for i, (_scale, variants) in enumerate(rungs):
    for j, v in enumerate(variants):
      axes[0].bar(
        i * (len(variants) + 1) + j,
        v.ms("fwd+bwd") / variants[0].ms("fwd+bwd"),
        color=f"C{j}",
        label=v.name if i == 0 else None,
      )
  axes[0].set_xticks([i * 5 + 1.5 for i in range(len(rungs))], [f"scale {s}" for s, _ in rungs])
  axes[0].set_ylabel("fwd+bwd time / dense MLP")
  axes[0].set_yscale("log")
  axes[0].legend(fontsize=8)
  depths = [int(pair[0].name.split()[2]) for pair in fff_rows]
  axes[1].plot(depths, [p[0].ms("fwd") for p in fff_rows], "o-", label="sparse (gated gather)")
  axes[1].plot(depths, [p[1].ms("fwd") for p in fff_rows], "s-", label="masked-dense")
  axes[1].set_xlabel("FFF depth")
  axes[1].set_ylabel("forward ms")
  axes[1].set_yscale("log")
  axes[1].legend(fontsize=8)
  axes[2].plot([n * n for n in n_keys_list], [v.ms("fwd") for v in sweep_variants], "o-")
  axes[2].set_xscale("log")
  axes[2].set_xlabel("d_ffw (neurons per channel)")
  axes[2].set_ylabel("sgatlin forward ms")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"\nwrote {path}")


TABLES = ("layers", "moe", "fff", "sweep", "table_grads")


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    tokens=flags.DEFINE_integer("tokens", 2048, "Tokens per step (a multiple of 256)."),
    dtype=flags.DEFINE_string("dtype", "float32", "Compute dtype (float32 is what a CPU runs fast)."),
    scales=cli.define_integer_list("scales", [2, 4], "Ladder rungs (d_model = 128 * scale)."),
    moe_scales=cli.define_integer_list("moe_scales", [2, 4], "Ladder rungs of the MoE table."),
    fff_depths=cli.define_integer_list("fff_depths", [4, 6, 8], "FFF tree depths."),
    sweep_n_keys=cli.define_integer_list("sweep_n_keys", [32, 64, 128, 256, 512], "sgatlin n_keys of the d_ffw sweep."),
    sweep_scale=flags.DEFINE_integer("sweep_scale", 1, "Ladder rung of the d_ffw sweep."),
    rounds=flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds (median)."),
    tables=flags.DEFINE_list("tables", list(TABLES), f"Tables to print, of {', '.join(TABLES)}."),
    grad_scales=cli.define_integer_list("grad_scales", [2], "Ladder rungs of the table-gradient table."),
    grad_gini=flags.DEFINE_float("grad_gini", 0.6, "Usage Gini of the skewed rows (what the model reports)."),
    grad_implementation=flags.DEFINE_string(
      "grad_implementation", "auto", "The table gradients' kernels (a registry name, e.g. mosaic or triton)."
    ),
    grad_chunks=cli.define_integer_list(
      "grad_chunks", [0, KernelOptions().segment_chunk], "kernel.segment_chunk values to compare (0: whole rows)."
    ),
    png=flags.DEFINE_string("png", None, "Write the plot to this PNG file."),
  )


def absl_main(argv, holders: dict):
  del argv
  args = cli.flag_values(holders)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {jax.device_count()} device(s)")
  unknown = sorted(set(args.tables) - set(TABLES))
  if unknown:
    cli.fail(
      f"--tables names {', '.join(unknown)}, which this benchmark does not print; use some of {', '.join(TABLES)}."
    )
  if args.png and set(args.tables) != set(TABLES):
    cli.fail("--png plots every table; drop --tables or --png.")
  on = set(args.tables).__contains__
  try:  # a flag giving an invalid layer (e.g. --sweep_n_keys at or below top_k) is one error line
    rungs = [(s, rung(s, args.tokens, args.dtype, args.rounds)) for s in args.scales] if on("layers") else []
    for s in args.moe_scales if on("moe") else []:
      moe_table(s, args.tokens, args.dtype, args.rounds)
    fff_rows = fff_table(args.fff_depths, args.tokens, args.dtype, args.rounds) if on("fff") else []
    sweep_variants = (
      sweep(args.sweep_n_keys, args.sweep_scale, args.tokens, args.dtype, args.rounds) if on("sweep") else []
    )
    for s in args.grad_scales if on("table_grads") else []:
      table_grads_table(
        s, args.tokens, args.dtype, args.rounds, args.grad_gini, args.grad_chunks, args.grad_implementation
      )
  except ConfigError as error:
    cli.fail(error)
  if args.png:
    plot(args.png, rungs, fff_rows, sweep_variants, args.sweep_n_keys)


def main():
  """The `sparsetx-bench-layers` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()

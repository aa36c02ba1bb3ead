"""Benchmark the product-key top-k (sgatlin's and PEER's router) on the current backend.

More: docs/modules.md, sparsetx/tools/bench_top_k.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from sparsetx import cli
from sparsetx.config import n_keys_for
from sparsetx.models.ffn import product_keys
from sparsetx.models.ladder import scaling_ladder
from sparsetx.perf import timing

N_CHANNELS, TOP_K = 16, 8


def lax_top_k_product_keys(scores1_N, scores2_N, k):
  """The formulation before the CPU passes: lax.top_k on each half, then on all k*k sums."""
  n_keys = scores1_N.shape[-1]
  s1, i1 = jax.lax.top_k(scores1_N.astype(jnp.float32), k)
  s2, i2 = jax.lax.top_k(scores2_N.astype(jnp.float32), k)
  flat_shape = s1.shape[:-1] + (k * k,)
  values, best = jax.lax.top_k((s1[..., :, None] + s2[..., None, :]).reshape(flat_shape), k)
  ids = (i1[..., :, None] * n_keys + i2[..., None, :]).reshape(flat_shape)
  return values, jnp.take_along_axis(ids, best, axis=-1)


def halves_sort(s_2RN, k):
  key = product_keys.order_key(s_2RN)
  iota = jax.lax.broadcasted_iota(jnp.int32, key.shape, 2)
  descending, ids = jax.lax.sort((~key, iota), dimension=2, num_keys=1, is_stable=True)
  return product_keys.from_order_key(~descending[..., :k]), ids[..., :k]


def halves_passes(chunk):
  """Stage one as product_keys runs it on CPU, with rows on the minor axis, in chunks of `chunk` rows."""

  def run(s_2RN, k):
    _, rows, n_keys = s_2RN.shape
    key_G2NC = product_keys.order_key(s_2RN).reshape(2, rows // chunk, chunk, n_keys).transpose(1, 0, 3, 2)
    keys_G2KC, ids_G2KC = jax.lax.map(lambda key: product_keys.halves_top_k_passes(key, k), key_G2NC)
    to_rows = lambda a: a.transpose(1, 0, 3, 2).reshape(2, rows, k)  # noqa: E731
    return product_keys.from_order_key(to_rows(keys_G2KC)), to_rows(ids_G2KC)

  return run


def with_chunk(chunk):
  return functools.partial(product_keys.product_key_top_k, cpu_rows_per_chunk=chunk)


def forward_backward(top_k):
  def loss(s1, s2, weights):
    return jnp.sum(top_k(s1, s2, TOP_K)[0] * weights)

  return jax.grad(loss, argnums=(0, 1))


def time_rounds(compiled, args, rounds):
  """Median seconds per variant, the variants interleaved within each round."""
  return timing.interleaved({name: functools.partial(fn, *args) for name, fn in compiled.items()}, rounds)


def equal_trees(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def stage_one_table(s_2RN, rounds):
  rows = s_2RN.shape[1]
  variants = {
    "lax.top_k": jax.lax.top_k,
    "approx_max_k recall 1.0": lambda s, k: jax.lax.approx_max_k(s, k, recall_target=1.0),
    "lax.sort (key, iota)": halves_sort,
    "passes, all rows": halves_passes(rows),
    "passes, 1024 rows": halves_passes(1024),
    "passes, 256 rows": halves_passes(256),
    "passes, 64 rows": halves_passes(64),
  }
  compiled = {name: jax.jit(lambda s, fn=fn: fn(s, TOP_K)) for name, fn in variants.items()}
  want = compiled["lax.top_k"](s_2RN)
  times = time_rounds(compiled, (s_2RN,), rounds)
  base = times["lax.top_k"]
  for name, fn in compiled.items():
    exact = equal_trees(fn(s_2RN), want)
    print(f"  {name:28s}{times[name] * 1e3:10.2f}{'':10s}{base / times[name]:9.2f}x{'':10s}  {exact}")


def full_table(s1, s2, rounds):
  weights = jax.random.randint(jax.random.key(2), s1.shape[:-1] + (TOP_K,), -8, 9).astype(jnp.float32)  # exact grads
  variants = {"lax.top_k x3 (before)": lax_top_k_product_keys}
  variants |= {f"passes, {c} rows": with_chunk(c) for c in (1024, 256, 64)}
  compiled_fwd = {name: jax.jit(lambda a, b, w, fn=fn: fn(a, b, TOP_K)) for name, fn in variants.items()}
  compiled_fb = {name: jax.jit(forward_backward(fn)) for name, fn in variants.items()}
  args = (s1, s2, weights)
  fwd, fb = time_rounds(compiled_fwd, args, rounds), time_rounds(compiled_fb, args, rounds)
  name0 = next(iter(variants))
  want = (compiled_fwd[name0](*args), compiled_fb[name0](*args))
  for name in variants:
    exact = equal_trees((compiled_fwd[name](*args), compiled_fb[name](*args)), want)
    print(
      f"  {name:28s}{fwd[name] * 1e3:10.2f}{fb[name] * 1e3:10.2f}"
      f"{fwd[name0] / fwd[name]:9.2f}x{fb[name0] / fb[name]:9.2f}x  {exact}"
    )


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    tokens=flags.DEFINE_integer("tokens", 2048, "Tokens per step (a multiple of 2048)."),
    scales=cli.define_integer_list("scales", [2, 4], "Ladder scales (n_keys 40, 64)."),
    rounds=flags.DEFINE_integer("rounds", 15, "Interleaved timing rounds (median)."),
  )


def absl_main(argv, holders: dict):
  del argv
  args = cli.flag_values(holders)
  if args.tokens % 2048:
    cli.fail(f"--tokens={args.tokens} must be a multiple of 2048 (the largest row chunk over 16 channels).")
  print(
    f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.tokens} tokens x {N_CHANNELS} channels, k={TOP_K}"
  )
  print(f"  {'variant':28s}{'fwd ms':>10s}{'f+b ms':>10s}{'fwd x':>10s}{'f+b x':>10s}  exact")
  for scale in args.scales:
    n_keys = n_keys_for(scaling_ladder(scale, "sgatlin")[2])
    k1, k2 = jax.random.split(jax.random.key(scale))
    s1, s2 = (jax.random.normal(key, (args.tokens, N_CHANNELS, n_keys)) for key in (k1, k2))
    print(f"scale {scale}, n_keys {n_keys}: stage one (top {TOP_K} of both halves)")
    stage_one_table(jnp.stack([s1, s2]).reshape(2, -1, n_keys), args.rounds)
    print(f"scale {scale}, n_keys {n_keys}: product_key_top_k")
    full_table(s1, s2, args.rounds)


def main():
  """The `sparsetx-bench-top-k` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()

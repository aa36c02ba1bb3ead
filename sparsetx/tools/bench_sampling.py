"""Generation speed with the KV cache against recomputing the window, side by side in one process.

  python -m sparsetx.tools.bench_sampling [--config=configs/tiny.py] [--ffn=mlp,sgatlin,fff] [--dtype=float32]
                                         [--batch=8] [--prompt=64] [--new=64]

For each feed-forward type: a random-init model of the config, `--batch` random byte prompts of
`--prompt` tokens, `--new` greedy tokens (EOS ignored), seconds per `Sampler.generate` call (the
median of 3 interleaved rounds after compiling) with `kv_cache=False` and `kv_cache=True`, their
ratio, and whether the tokens agree.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import flags

from sparsetx import cli
from sparsetx import config as config_lib
from sparsetx.evaluate import sampling
from sparsetx.models.transformer import Transformer
from sparsetx.perf import timing


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    config=flags.DEFINE_string("config", "configs/tiny.py", "A config file taking the ffn type as its argument."),
    ffn=flags.DEFINE_list("ffn", ["mlp", "sgatlin", "fff"], "Feed-forward types."),
    dtype=flags.DEFINE_string("dtype", "float32", "config.model.dtype."),
    batch=flags.DEFINE_integer("batch", 8, "Prompts per call."),
    prompt=flags.DEFINE_integer("prompt", 64, "Tokens per prompt."),
    new=flags.DEFINE_integer("new", 64, "Greedy tokens generated per prompt."),
  )


def load_config(path: str, ffn: str, dtype: str) -> ml_collections.ConfigDict:
  """The config file's get_config(ffn), a path relative to the working directory (the repository root)."""
  config = cli.load_config_file("config", f"{path}:{ffn}")
  config.model.dtype = dtype
  return config_lib.validate(config)


def seconds_per_call(samplers: dict, prompts, new_tokens, rounds: int = 3) -> tuple[dict, dict]:
  """Each sampler's median seconds per `generate` call, side by side, and the tokens its first (compiling) call
  gave."""
  tokens = {name: sampler.generate(prompts, new_tokens) for name, sampler in samplers.items()}
  calls = {name: functools.partial(sampler.generate, prompts, new_tokens) for name, sampler in samplers.items()}
  return timing.interleaved(calls, rounds, warm=False), tokens


def absl_main(argv, holders: dict):
  del argv
  args = cli.flag_values(holders)
  print(f"{args.config}, {args.dtype}, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens (greedy)")
  print(f"{'ffn':<10}{'recompute s':>12}{'kv cache s':>12}{'speed-up':>10}{'same tokens':>13}")
  for ffn in args.ffn:
    try:
      config = load_config(args.config, ffn, args.dtype)
    except config_lib.ConfigError as error:
      cli.fail(error)
    if args.prompt + args.new > config.model.max_len:
      cli.fail(f"--prompt + --new = {args.prompt + args.new} exceeds config.model.max_len={config.model.max_len}.")
    model = Transformer(ml_collections.FrozenConfigDict(config.model))
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    prompts = np.random.default_rng(0).integers(2, 259, (args.batch, args.prompt)).tolist()
    samplers = {
      kv_cache: sampling.Sampler(
        model, params, config.model.max_len, batch_size=args.batch, eos_id=-1, kv_cache=kv_cache
      )
      for kv_cache in (False, True)
    }
    seconds, tokens = seconds_per_call(samplers, prompts, args.new)
    recompute, cached = seconds[False], seconds[True]
    print(
      f"{ffn:<10}{recompute:>12.3f}{cached:>12.3f}{recompute / cached:>9.1f}x{str(tokens[False] == tokens[True]):>13}"
    )


def main():
  """The `sparsetx-bench-sampling` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()

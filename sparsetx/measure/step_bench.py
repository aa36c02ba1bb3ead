"""The train step of each feed-forward type at one ladder rung, compiled and timed side by side.

Shared by sparsetx/tools/bench_train_step.py (its table) and sparsetx/tools/accelerator_check.py: every type is built
at the same rung with the same batch, length, dtype and devices (all on the data axis), compiled first, then timed
in interleaved rounds (one step of each type per round, so drift and noise hit every type alike).
"""

import jax
import numpy as np
from absl import flags

from sparsetx import config as config_lib
from sparsetx import hardware
from sparsetx.data.batches import abstract_batch
from sparsetx.models import ladder
from sparsetx.parallel import logical_rules
from sparsetx.perf import timing
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib


def define_rung_flags() -> dict:
  """The absl flags that shape a benchmark's rung (bench_train_step, bench_step_parts: `rung_config` reads them)."""
  return dict(
    scale=flags.DEFINE_integer("scale", None, "Ladder rung (default 2; 1 with --small)."),
    batch=flags.DEFINE_integer("batch", 8, "Sequences per step."),
    seq_len=flags.DEFINE_integer("seq_len", None, "Default 512; 64 with --small."),
    dtype=flags.DEFINE_string("dtype", None, "Default bfloat16; float32 with --small (what a CPU runs fast)."),
    small=flags.DEFINE_bool("small", False, "A CPU-sized shape: scale 1, 2 layers, vocab 512, 8 x 64."),
    implementation=flags.DEFINE_string(
      "implementation", None, "The sparse layers' kernels (config.model.ffn.kernel.implementation; default auto)."
    ),
    logits_dot_in_fp32=flags.DEFINE_bool("logits_dot_in_fp32", True, "The LM head's dot on float32 operands."),
    loss_chunks=flags.DEFINE_integer("loss_chunks", None, "Vocabulary tiles of the loss (default: the config's)."),
    remat=flags.DEFINE_enum(
      "remat", "none", list(config_lib.REMAT_POLICIES), "Recompute in the backward (the ladder's: full)."
    ),
  )


def rung_config(ffn_type: str, args) -> config_lib.ml_collections.ConfigDict:
  """The ladder rung of `ffn_type` with the benchmark's batch, length and dtype (and --small's cuts)."""
  config = config_lib.default_config()
  config.model = ladder.ladder_model_config(args.scale, ffn_type)
  config.model.update(dtype=args.dtype, max_len=max(config.model.max_len, args.seq_len))
  if args.small:
    config.model.update(n_layers=2, vocab_size=512)
  config.data.update(seq_len=args.seq_len, global_batch_size=args.batch, eval_batch_size=args.batch)
  if getattr(args, "implementation", None) and "kernel" in config.model.ffn:  # the kernels the sparse layers run
    config.model.ffn.kernel.implementation = args.implementation
  config.model.logits_dot_in_fp32 = getattr(args, "logits_dot_in_fp32", True)
  # One device holds a benchmark rung's activations: no recompute unless asked (the ladder trains with "full").
  config.model.remat = getattr(args, "remat", None) or "none"
  if getattr(args, "loss_chunks", None) is not None:
    config.train.loss_chunks = args.loss_chunks
  config.train.update(steps=1000, warmup_steps=10)
  return config_lib.validate(config)


def step_words(config) -> str:
  """How the step runs, in words: its remat policy, the LM head's dot's operands and the loss's vocabulary tiles."""
  operands = "float32" if config.model.logits_dot_in_fp32 else config.model.dtype
  tiles = config_lib.loss_chunk_count(config.model.vocab_size, config.train.loss_chunks)
  return (
    f"remat {config.model.remat}, LM head on {operands} operands, {tiles} vocabulary tile{'s' if tiles > 1 else ''}"
  )


class TypeStep:
  """One type's compiled train step, its state and a fixed batch; times one step at a time."""

  def __init__(self, ffn_type: str, args, devices, config=None, usage: bool = True):
    """`config`: the rung's (rung_config) unless given. `usage` False: the state keeps no usage counts
    (usage_window.py), so the step leaves out their accumulation (its cost, side by side)."""
    self.name = ffn_type
    config = self.config = config or rung_config(ffn_type, args)
    built = state_lib.setup(config, devices)
    shardings = built.shardings
    B, T = args.batch, args.seq_len
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (B, T + 1), dtype=np.int32)
    batch = dict(
      inputs=tokens[:, :-1],
      targets=tokens[:, 1:],
      segment_ids=np.ones((B, T), np.int32),
      positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)),
      loss_weights=np.ones((B, T), np.float32),
    )
    self.batch = jax.device_put(batch, built.batch_sharding)
    with logical_rules.activate(built.mesh, config.mesh.rules):
      self.state = state_lib.create_state(config, shardings, built.model, built.tx)
      if not usage:
        self.state = self.state.replace(usage={})
        built = built._replace(shardings=shardings.replace(usage={}))
      with timing.Stopwatch() as clock:
        self.step = step_lib.make_train_step(config, built).lower(self.state, self.batch).compile()
      self.compile_s = clock.seconds
    self.tokens = B * T
    self.model_flops = 3 * ladder.forward_flops_per_token(config.model, T)["total"] * self.tokens
    self.params = ladder.param_counts(config.model)
    self.seconds = None  # median seconds per step, from measure

  def __call__(self):
    """One step; the state carries on, so every call trains from the last."""
    self.state, metrics = self.step(self.state, self.batch)
    return metrics


def with_defaults(args):
  """args with the shape defaults filled in (--small: scale 1, 64 tokens per sequence, float32)."""
  args.scale = args.scale or (1 if args.small else 2)
  args.seq_len = args.seq_len or (64 if args.small else 512)
  args.dtype = args.dtype or ("float32" if args.small else "bfloat16")
  return args


def measure(args, devices) -> list:
  """Each type's TypeStep (under each of `args.bad_steps`' modes and `args.usage_counts`' on/off, when given: named
  type/mode/counts), compiled and timed in `args.rounds` interleaved rounds (the acceptance script too)."""
  modes = getattr(args, "bad_steps", None) or ["stop"]
  counting = getattr(args, "usage_counts", None) or ["on"]
  steps = []
  for ffn_type in args.types:
    for mode in modes:
      for counts in counting:
        config = rung_config(ffn_type, args)
        config.train.bad_steps = mode
        steps.append(TypeStep(ffn_type, args, devices, config_lib.validate(config), usage=counts == "on"))
        steps[-1].name = "/".join(
          [ffn_type] + ([mode] if len(modes) > 1 else []) + ([f"counts {counts}"] if len(counting) > 1 else [])
        )
  for step, seconds in timing.interleaved({s: s for s in steps}, args.rounds).items():
    step.seconds = seconds
  return steps


def peak_flops(args, devices) -> float | None:
  chip = hardware.chip_of(devices[0].device_kind)
  return args.peak_tflops * 1e12 if args.peak_tflops else chip.peak_flops if chip else None


def compiled_usage_cost(config, topology_name: str) -> dict:
  """{'on'|'off': aot.Report} of the train step compiled for a topology by its own compiler (libtpu, XLA's GPU
  compiler), with and without the window's usage counts in its state: what accumulating them adds."""
  from sparsetx.measure import aot  # noqa: PLC0415  (the target's compiler: only when asked)

  mesh = aot.topology_mesh(config, topology_name)
  found = {}
  for counts in ("on", "off"):
    built = state_lib.setup(config, mesh=mesh)
    if counts == "off":
      built = built._replace(
        abstract_state=built.abstract_state.replace(usage={}), shardings=built.shardings.replace(usage={})
      )
    with logical_rules.activate(mesh, config.mesh.rules):
      traced = step_lib.make_train_step(config, built).trace(
        built.abstract_state, abstract_batch(config, built.batch_sharding)
      )
      found[counts] = aot.report_of(aot.compile_traced(traced, mesh), built, config, mesh)
  return found

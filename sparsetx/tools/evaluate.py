"""`python -m sparsetx.evaluate --workdir=DIR [--step=N] [--task=facts,stories] [--mesh=one|saved|data=2,...]`.

Prints each validation task's loss (nats per token) and perplexity, the numbers the trainer logs
as `eval/<task>/loss` and `eval/<task>/perplexity` (see sparsetx/evaluate/perplexity.py), and with
`--prompt` samples a continuation (`--temperature 0` is greedy; `--top_k`, `--seed`,
`--max_new_tokens`; `--sample_dtype`, float32 by default, and the line names it). `--noeval` skips the perplexity pass;
`--eval_dtype=float32` computes it in float32 instead of the training dtype. A bad flag, a missing workdir, a missing
or damaged checkpoint (the line names the step and the other saved steps, for `--step`) or an
unknown task ends the run with one `error:` line and exit code 2 (sparsetx/cli.py).
"""

from types import SimpleNamespace

from absl import flags

from sparsetx import cli, paths
from sparsetx.config import ConfigError


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    workdir=flags.DEFINE_string("workdir", None, "Training workdir holding checkpoints/.", required=True),
    step=flags.DEFINE_integer("step", None, "Checkpoint step; default the latest."),
    task=flags.DEFINE_list("task", None, "Tasks (a comma list) to evaluate; default the checkpoint's mixture."),
    eval_batches=flags.DEFINE_integer("eval_batches", None, "Batches per task; 0 = all; default the checkpoint's."),
    mesh=flags.DEFINE_string("mesh", "one", "'one' device, 'saved' (the training mesh) or ici sizes: data=2,fsdp=4."),
    eval=flags.DEFINE_bool("eval", True, "Report validation loss and perplexity."),
    eval_dtype=flags.DEFINE_enum(
      "eval_dtype",
      "saved",
      ["saved", "float32", "bfloat16"],
      "Compute dtype of the loss pass. 'saved' (config.model.dtype) reproduces the trainer's eval/ numbers; in "
      "bfloat16 they move by about 1e-4 (relative) between compiled programs, meshes included, as XLA rounds fused "
      "intermediates differently and top-k choices near a tie flip. float32 agrees across meshes to about 1e-6.",
    ),
    prompt=flags.DEFINE_string("prompt", None, "Text to continue; nothing is sampled without it."),
    max_new_tokens=flags.DEFINE_integer("max_new_tokens", 64, "Tokens to sample at most (stops at EOS)."),
    temperature=flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy."),
    top_k=flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0 = all."),
    seed=flags.DEFINE_integer("seed", 0, "Sampling seed."),
    sample_dtype=flags.DEFINE_enum(
      "sample_dtype",
      "float32",
      ["float32", "bfloat16"],
      "Compute dtype of --prompt's sampling (the parameters are float32 either way). Default float32: near-tied "
      "logits then pick the same token as the float32 Hugging Face export (sparsetx.tools.export); bfloat16 is "
      "the checkpoint's training dtype (config.model.dtype), faster on a GPU or TPU, and its greedy text can differ.",
    ),
  )


def run(args: SimpleNamespace) -> str:
  """Evaluates and samples as the flags' values `args` say; returns the printed report."""
  from sparsetx.evaluate import perplexity, sampling
  from sparsetx.interp import checkpoint as checkpoint_lib
  from sparsetx.train import state as state_lib

  config, mesh, model, params, step = perplexity.restore(args.workdir, args.step, args.mesh, args.task)
  lines = [f"checkpoint {args.workdir} step {step}, mesh {dict(mesh.shape)}"]
  if args.eval:
    eval_config = config.copy_and_resolve_references()
    if args.eval_dtype != "saved":
      eval_config.model.dtype = args.eval_dtype
    eval_model = state_lib.build_model(eval_config)
    results = perplexity.evaluate(eval_config, mesh, eval_model, params, args.eval_batches)
    lines.append(f"loss computed in {eval_config.model.dtype}")
    lines.append(f"{'task':<20} {'loss (nats/token)':>18} {'perplexity':>12}")
    for key in results:
      if key.endswith("/loss"):
        name = key[len("eval/") : -len("/loss")]
        lines.append(f"{name:<20} {results[key]:>18.6f} {results[f'eval/{name}/perplexity']:>12.4f}")
  if args.prompt is not None:
    vocabulary = checkpoint_lib.vocabulary(config)
    sample_config = config.copy_and_resolve_references()
    sample_config.model.dtype = args.sample_dtype
    sample_model = state_lib.build_model(sample_config)
    sampler = sampling.Sampler(sample_model, params, config.model.max_len, batch_size=1, eos_id=vocabulary.eos_id)
    prompt = checkpoint_lib.encode_prompt(vocabulary, args.prompt)
    (new,) = sampler.generate([prompt], args.max_new_tokens, args.temperature, args.top_k, args.seed)
    lines.append(f"prompt: {args.prompt!r}")
    lines.append(f"sample ({args.sample_dtype}): {vocabulary.decode(new)!r}")
  report = "\n".join(lines)
  print(report)
  return report


def absl_main(argv, holders: dict):
  del argv
  args = cli.flag_values(holders)
  try:
    if not (paths.resolve(args.workdir) / "checkpoints").is_dir():  # before the slow imports (local or gs://)
      raise ConfigError(
        f"--workdir={args.workdir!r} holds no checkpoints/ directory; give the workdir of a training run."
      )
    run(args)
  except ConfigError as error:
    cli.fail(error)


def main():
  """`python -m sparsetx.evaluate` and the `sparsetx-evaluate` script."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()

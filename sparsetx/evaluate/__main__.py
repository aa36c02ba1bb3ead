"""`python -m sparsetx.evaluate --workdir=DIR [--step=N] [--task=facts,stories] [--mesh=one|saved|data=2,...]`.

Prints each validation task's loss (nats per token) and perplexity, the numbers the trainer logs
as `eval/<task>/loss` and `eval/<task>/perplexity` (see sparsetx/evaluate/perplexity.py), and with
`--prompt` samples a continuation (`--temperature 0` is greedy; `--top_k`, `--seed`,
`--max_new_tokens`; `--sample_dtype`, float32 by default, and the line names it). `--noeval` skips the perplexity pass;
`--eval_dtype=float32` computes it in float32 instead of the training dtype. A bad flag, a missing workdir, a missing
or damaged checkpoint (the line names the step and the other saved steps, for `--step`) or an
unknown task ends the run with one `error:` line and exit code 2 (sparsetx/cli.py).
"""

from absl import flags

from sparsetx import cli, paths
from sparsetx.config import ConfigError

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir holding checkpoints/.", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default the latest.")
_TASK = flags.DEFINE_list("task", None, "Tasks (a comma list) to evaluate; default the checkpoint's mixture.")
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", None, "Batches per task; 0 = all; default the checkpoint's.")
_MESH = flags.DEFINE_string("mesh", "one", "'one' device, 'saved' (the training mesh) or ici sizes: data=2,fsdp=4.")
_EVAL = flags.DEFINE_bool("eval", True, "Report validation loss and perplexity.")
_EVAL_DTYPE = flags.DEFINE_enum(
  "eval_dtype",
  "saved",
  ["saved", "float32", "bfloat16"],
  "Compute dtype of the loss pass. 'saved' (config.model.dtype) reproduces the trainer's eval/ numbers; in bfloat16 "
  "they move by about 1e-4 (relative) between compiled programs, meshes included, as XLA rounds fused "
  "intermediates differently and top-k choices near a tie flip. float32 agrees across meshes to about 1e-6.",
)
_PROMPT = flags.DEFINE_string("prompt", None, "Text to continue; nothing is sampled without it.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to sample at most (stops at EOS).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0 = all.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_SAMPLE_DTYPE = flags.DEFINE_enum(
  "sample_dtype",
  "float32",
  ["float32", "bfloat16"],
  "Compute dtype of --prompt's sampling (the parameters are float32 either way). Default float32: near-tied "
  "logits then pick the same token as the float32 Hugging Face export (sparsetx.tools.export); bfloat16 is "
  "the checkpoint's training dtype (config.model.dtype), faster on a GPU or TPU, and its greedy text can differ.",
)


def run() -> str:
  """Evaluates and samples as the flags say; returns the printed report."""
  from sparsetx.evaluate import perplexity, sampling
  from sparsetx.interp import checkpoint as checkpoint_lib
  from sparsetx.train import state as state_lib

  config, mesh, model, params, step = perplexity.restore(_WORKDIR.value, _STEP.value, _MESH.value, _TASK.value)
  lines = [f"checkpoint {_WORKDIR.value} step {step}, mesh {dict(mesh.shape)}"]
  if _EVAL.value:
    eval_config = config.copy_and_resolve_references()
    if _EVAL_DTYPE.value != "saved":
      eval_config.model.dtype = _EVAL_DTYPE.value
    eval_model = state_lib.build_model(eval_config)
    results = perplexity.evaluate(eval_config, mesh, eval_model, params, _EVAL_BATCHES.value)
    lines.append(f"loss computed in {eval_config.model.dtype}")
    lines.append(f"{'task':<20} {'loss (nats/token)':>18} {'perplexity':>12}")
    for key in results:
      if key.endswith("/loss"):
        name = key[len("eval/") : -len("/loss")]
        lines.append(f"{name:<20} {results[key]:>18.6f} {results[f'eval/{name}/perplexity']:>12.4f}")
  if _PROMPT.value is not None:
    vocabulary = checkpoint_lib.vocabulary(config)
    sample_config = config.copy_and_resolve_references()
    sample_config.model.dtype = _SAMPLE_DTYPE.value
    sample_model = state_lib.build_model(sample_config)
    sampler = sampling.Sampler(sample_model, params, config.model.max_len, batch_size=1, eos_id=vocabulary.eos_id)
    prompt = checkpoint_lib.encode_prompt(vocabulary, _PROMPT.value)
    (new,) = sampler.generate([prompt], _MAX_NEW_TOKENS.value, _TEMPERATURE.value, _TOP_K.value, _SEED.value)
    lines.append(f"prompt: {_PROMPT.value!r}")
    lines.append(f"sample ({_SAMPLE_DTYPE.value}): {vocabulary.decode(new)!r}")
  report = "\n".join(lines)
  print(report)
  return report


def main(argv):
  del argv
  try:
    if not (paths.resolve(_WORKDIR.value) / "checkpoints").is_dir():  # before the slow imports (local or gs://)
      raise ConfigError(
        f"--workdir={_WORKDIR.value!r} holds no checkpoints/ directory; give the workdir of a training run."
      )
    run()
  except ConfigError as error:
    cli.fail(error)


if __name__ == "__main__":
  cli.run(main)

"""python -m sparsetx.evaluate on a micro model trained for 20 steps: the trainer's eval numbers on
another mesh, the loss computed directly, greedy / top-k sampling against a step-by-step argmax, errors."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from test_train import micro_config

from sparsetx import config as config_lib
from sparsetx.evaluate import perplexity, sampling
from sparsetx.interp import checkpoint as checkpoint_lib
from sparsetx.train import state as state_lib
from sparsetx.train.run import loop


def trained_workdir(tmp_path_factory) -> str:
  """One micro sgatlin model per test session (shared by test_lm_eval.py), trained with an eval at the end.

  The facts task alone and two saves: the same compiled programs as test_train's, without the stories splits.
  """
  workdir = str(tmp_path_factory.getbasetemp() / "evaluate_micro")
  if not os.path.isdir(os.path.join(workdir, "checkpoints", "20")):
    config = micro_config("sgatlin")
    config.data.mixture = (("facts", 1.0),)
    config.checkpoint.every = 10
    loop.train(config, workdir)
  return workdir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return trained_workdir(tmp_path_factory)


@pytest.fixture(scope="module")
def restored(workdir):
  return perplexity.restore(workdir)


def final_eval(workdir) -> dict:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [row for row in rows if any(key.startswith("eval/") for key in row)][-1]


def test_loss_equals_trainer_eval_and_direct_computation(workdir, restored):
  config, mesh, model, params, step = restored
  assert step == 20 and mesh.size == 1
  results = perplexity.evaluate(config, mesh, model, params, eval_batches=1)
  trainer = final_eval(workdir)  # 8 devices (data=8), the same first validation batch of facts
  np.testing.assert_allclose(results["eval/facts/loss"], trainer["eval/facts/loss"], rtol=1e-5)
  np.testing.assert_allclose(results["eval/facts/perplexity"], np.exp(results["eval/facts/loss"]), rtol=1e-6)

  rows = checkpoint_lib.validation_rows(config, config.data.eval_batch_size, task="facts")
  logits_BTV = np.asarray(model.apply({"params": params}, rows["inputs"], rows["positions"], rows["segment_ids"]))
  max_BT1 = logits_BTV.max(-1, keepdims=True)
  logprobs_BTV = logits_BTV - max_BT1 - np.log(np.exp(logits_BTV - max_BT1).sum(-1, keepdims=True))
  target_BT = np.take_along_axis(logprobs_BTV, rows["targets"][..., None], -1)[..., 0]
  direct = -(target_BT * rows["loss_weights"]).sum() / rows["loss_weights"].sum()
  np.testing.assert_allclose(results["eval/facts/loss"], direct, rtol=1e-5)


def run_cli(*flags):
  return subprocess.run(
    [sys.executable, "-m", "sparsetx.evaluate", *flags], cwd=REPO, capture_output=True, text=True, timeout=300
  )


def greedy_reference(model, params, prompt, max_new, max_len, eos_id):
  """Argmax of the model's next-token logits on the growing prefix, one token at a time (the prefix
  padded to max_len with segment id 0, so one compiled forward serves every length)."""
  forward = jax.jit(lambda p, t, s: model.apply({"params": p}, t, jnp.arange(max_len)[None], s))
  tokens = list(prompt)
  for _ in range(max_new):
    padded, segments = np.zeros((1, max_len), np.int32), np.zeros((1, max_len), np.int32)
    padded[0, : len(tokens)], segments[0, : len(tokens)] = tokens, 1
    next_id = int(np.argmax(forward(params, padded, segments)[0, len(tokens) - 1]))
    if next_id == eos_id:
      break
    tokens.append(next_id)
  return tokens[len(prompt) :]


def test_cli_on_another_mesh_reports_trainer_eval_and_greedy_sample(workdir, restored):
  """Trained on data=8; restored onto data=2 x fsdp=2 x expert=2 (tables resharded by channel)."""
  result = run_cli(
    f"--workdir={workdir}",
    "--mesh=data=2,fsdp=2,expert=2",
    "--eval_batches=1",
    "--prompt=The ball was",
    "--max_new_tokens=6",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert "'data': 2, 'fsdp': 2, 'tensor': 1, 'expert': 2" in lines[0]
  (facts,) = [line.split() for line in lines if line.startswith("facts ")]
  np.testing.assert_allclose(float(facts[1]), final_eval(workdir)["eval/facts/loss"], rtol=1e-5)
  config, _, model, params, _ = restored
  vocabulary = checkpoint_lib.vocabulary(config)
  prompt = checkpoint_lib.encode_prompt(vocabulary, "The ball was")
  want = greedy_reference(model, params, prompt, 6, config.model.max_len, vocabulary.eos_id)
  assert lines[-1] == f"sample (float32): {vocabulary.decode(want)!r}"  # --sample_dtype's default


@pytest.mark.long  # a system case of half a minute or more: make test-long
def test_cli_evaluates_and_samples_in_the_dtypes_asked_for(workdir, restored):
  """--eval_dtype / --sample_dtype=bfloat16 run the model in bfloat16 (the same evaluation and sampler, built
  here, agree), and the report says so."""
  config, mesh, _, params, _ = restored
  result = run_cli(
    f"--workdir={workdir}",
    "--eval_batches=1",
    "--eval_dtype=bfloat16",
    "--prompt=The ball was",
    "--max_new_tokens=6",
    "--sample_dtype=bfloat16",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  bf16 = config.copy_and_resolve_references()
  bf16.model.dtype = "bfloat16"
  lines = result.stdout.splitlines()
  assert lines[1] == "loss computed in bfloat16"
  (facts,) = [line.split() for line in lines if line.startswith("facts ")]
  want_loss = perplexity.evaluate(bf16, mesh, state_lib.build_model(bf16), params, eval_batches=1)["eval/facts/loss"]
  assert float(facts[1]) == pytest.approx(want_loss, abs=5e-7)  # the same program; printed to 6 decimals
  vocabulary = checkpoint_lib.vocabulary(config)
  prompt = checkpoint_lib.encode_prompt(vocabulary, "The ball was")
  sampler = sampling.Sampler(state_lib.build_model(bf16), params, config.model.max_len, 1, vocabulary.eos_id)
  (want,) = sampler.generate([prompt], 6)
  assert result.stdout.splitlines()[-1] == f"sample (bfloat16): {vocabulary.decode(want)!r}"


def test_greedy_sampling_equals_stepwise_argmax_and_top_k_1(restored):
  config, _, model, params, _ = restored
  vocabulary = checkpoint_lib.vocabulary(config)
  prompts = [checkpoint_lib.encode_prompt(vocabulary, text) for text in ("The ball was", "Once", "Tom the dog said")]
  sampler = sampling.Sampler(model, params, config.model.max_len, batch_size=4, eos_id=vocabulary.eos_id)
  greedy = sampler.generate(prompts, max_new_tokens=7)
  for prompt, got in zip(prompts, greedy):
    assert got == greedy_reference(model, params, prompt, 7, config.model.max_len, vocabulary.eos_id)
  assert sampler.generate(prompts, max_new_tokens=7, temperature=1.0, top_k=1, seed=3) == greedy
  sampled = sampler.generate(prompts, max_new_tokens=7, temperature=5.0, seed=3)
  assert sampled == sampler.generate(prompts, max_new_tokens=7, temperature=5.0, seed=3)  # the seed fixes it
  assert sampled != greedy


def test_long_prompt_keeps_its_newest_tokens(restored):
  config, _, model, params, _ = restored
  sampler = sampling.Sampler(model, params, config.model.max_len, batch_size=4)
  prompt = list(range(3, 3 + 2 * config.model.max_len))
  keep = config.model.max_len - 5
  assert sampler.generate([prompt], 5) == sampler.generate([prompt[-keep:]], 5)
  with pytest.raises(config_lib.ConfigError, match="max_new_tokens=32 must be between 1 and 31"):
    sampler.generate([prompt], config.model.max_len)


def test_errors_are_one_line(workdir, tmp_path):
  result = run_cli(f"--workdir={tmp_path / 'missing'}")
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
    f"error: --workdir={str(tmp_path / 'missing')!r} holds no checkpoints/ directory; give the workdir of a training run."
  )
  os.makedirs(tmp_path / "empty" / "checkpoints")
  with pytest.raises(config_lib.ConfigError, match="has no complete checkpoint") as error:
    perplexity.restore(str(tmp_path / "empty"))
  with pytest.raises(config_lib.ConfigError, match=r"--step=7 is not a checkpoint .* saved steps: \[10, 20\]"):
    perplexity.restore(workdir, step=7)
  with pytest.raises(config_lib.ConfigError, match="task 'poems' is neither built in") as error:
    perplexity.restore(workdir, tasks=["facts", "poems"])
  assert "\n" not in str(error.value)
  with pytest.raises(config_lib.ConfigError, match="--mesh='data=two'"):
    perplexity.mesh_config(config_lib.default_config(), "data=two")

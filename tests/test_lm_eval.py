"""The lm-eval adapter on the micro model of test_evaluate.py: its log-likelihoods equal sums of token
log-probs computed directly from the model, rolling windows are lm-eval's, generation honours `until` and
`max_gen_toks`, and lm-eval runs the local fact tasks offline end to end."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from lm_eval import evaluator
from lm_eval import utils as lm_eval_utils
from lm_eval.api import registry
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager
from test_evaluate import trained_workdir

from sparsetx import config as config_lib
from sparsetx.data import corpus
from sparsetx.evaluate import lm_eval_adapter, scoring
from sparsetx.evaluate.lm_eval_tasks import make_tasks

TASKS_DIR = os.path.join(REPO, "sparsetx", "evaluate", "lm_eval_tasks")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return trained_workdir(tmp_path_factory)


@pytest.fixture(scope="module")
def lm(workdir):
  return lm_eval_adapter.SparsetxLM(workdir=workdir, batch_size=4)


def requests(kind, *arguments):
  return [Instance(request_type=kind, doc={}, arguments=args, idx=0) for args in arguments]


class Direct:
  """Sums of target log-probs from one unpadded forward pass per token sequence (no batching, no padding).

  The test requests share two lengths (18 and max_len inputs), so this compiles twice."""

  def __init__(self, lm):
    self.lm = lm
    self.forward = jax.jit(lambda params, tokens: lm.scorer.model.apply({"params": params}, tokens))

  def score(self, tokens, n_continuation):
    """(log-prob of the last n tokens given the rest, whether each is the argmax), the oldest tokens cut to fit."""
    tokens = tokens[-(self.lm.max_len + 1) :]
    logits_TV = np.asarray(self.forward(self.lm.scorer.params, jnp.asarray([tokens[:-1]])))[0]
    logprobs_TV = np.asarray(jax.nn.log_softmax(logits_TV, axis=-1))
    targets = np.asarray(tokens[1:])
    picked = slice(len(targets) - n_continuation, len(targets))
    total = logprobs_TV[picked][np.arange(n_continuation), targets[picked]].sum()
    return float(total), bool((logits_TV[picked].argmax(-1) == targets[picked]).all())


def test_registered_for_the_cli():
  assert registry.get_model("sparsetx") is lm_eval_adapter.SparsetxLM


def test_loglikelihood_equals_direct_sum_of_token_log_probs(lm):
  encode, vocabulary = lm.encode, lm.vocabulary
  greedy = vocabulary.decode(lm.sampler.generate([[0] + encode("The ball was")], 6)[0])
  long_context = "Lily the cat lived in a little house by the park. One day she"
  cases = [
    ("The ball was", " full.", [0] + encode("The ball was"), encode(" full.")),
    ("The kite was ", "white.", [0] + encode("The kite was"), encode(" white.")),  # the space moves over
    ("", "The pie was sweet.", [0], encode("The pie was sweet.")),
    (long_context, " went out.", [0] + encode(long_context), encode(" went out.")),  # longer than max_len
    ("The ball was", greedy, [0] + encode("The ball was"), encode(greedy)),  # greedy by construction
  ]
  assert len(cases[3][2]) + len(cases[3][3]) > lm.max_len + 1
  got = lm.loglikelihood(requests("loglikelihood", *[(c, x) for c, x, _, _ in cases]))
  direct = Direct(lm)
  for (context, continuation, context_ids, continuation_ids), (logprob, is_greedy) in zip(cases, got):
    want_logprob, want_greedy = direct.score(context_ids + continuation_ids, len(continuation_ids))
    np.testing.assert_allclose(logprob, want_logprob, rtol=1e-5, err_msg=repr((context, continuation)))
    assert is_greedy == want_greedy
  assert got[-1][1] and not got[0][1]


def test_loglikelihood_rolling_uses_lm_evals_windows(lm):
  text = "Once upon a time, there was a little cat named Lily. Lily lived in a little house by the park."
  tokens = lm.encode(text)
  assert len(tokens) > 2 * lm.max_len

  def lm_eval_windows(tokens):
    windows = lm_eval_utils.get_rolling_token_windows(tokens, 0, lm.max_len, 1)
    return [tuple(map(list, lm_eval_utils.make_disjoint_window(window))) for window in windows]

  for n in (1, 5, lm.max_len, lm.max_len + 1, len(tokens)):  # same windows as lm-eval's for any length
    assert scoring.rolling_windows(tokens[:n], 0, lm.max_len) == lm_eval_windows(tokens[:n])
  direct = Direct(lm)
  want = sum(direct.score(context + target, len(target))[0] for context, target in lm_eval_windows(tokens))
  (got,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", (text,)))
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_generate_until_honours_until_and_max_gen_toks(lm):
  prompt = "The cup was"
  full = lm.vocabulary.decode(lm.sampler.generate([[0] + lm.encode(prompt)], 8)[0])
  stop = full[3:5]
  assert stop and stop in full
  got = lm.generate_until(
    requests(
      "generate_until",
      (prompt, dict(until=[stop], max_gen_toks=8)),
      (prompt, dict(until=["\n\n"], max_gen_toks=5)),
      (prompt, dict(until="never there", max_gen_toks=8, do_sample=False)),
    )
  )
  assert got == [full[: full.index(stop)], full[:5], full]


def test_local_tasks_end_to_end_offline(workdir, lm, monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.chdir(REPO)  # the task files name facts.jsonl from the repository root
  names = ["sparsetx_facts_cloze", "sparsetx_facts_choice"]
  results = evaluator.simple_evaluate(
    model=lm,
    tasks=names,
    limit=3,  # the registered class, built in the fixture (model="sparsetx" builds the same)
    task_manager=TaskManager(include_path=TASKS_DIR, include_defaults=False),
  )["results"]
  docs = make_tasks.documents()[:3]
  adjectives = [f"{adjective}." for _, adjective in corpus.facts()]
  for name, choices_of, label_of in (
    ("sparsetx_facts_cloze", lambda d: adjectives, lambda d: d["label"]),
    ("sparsetx_facts_choice", lambda d: d["choices"], lambda d: d["choice_label"]),
  ):
    correct = []
    for doc in docs:
      context = f"The {doc['noun']} was"
      scores = lm.loglikelihood(requests("loglikelihood", *[(context, f" {c}") for c in choices_of(doc)]))
      correct.append(int(np.argmax([s for s, _ in scores])) == label_of(doc))
    assert 0.0 <= results[name]["acc,none"] <= 1.0
    assert results[name]["acc,none"] == pytest.approx(np.mean(correct))


def test_task_files_are_generated_from_the_corpus():
  with open(os.path.join(TASKS_DIR, "facts.jsonl")) as f:
    assert [json.loads(line) for line in f] == make_tasks.documents()
  with open(os.path.join(TASKS_DIR, "sparsetx_facts_cloze.yaml")) as f:
    assert f.read().endswith(make_tasks.cloze_yaml())


def test_errors_are_one_line(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="holds no checkpoints/ directory") as error:
    lm_eval_adapter.SparsetxLM(workdir=str(tmp_path))
  assert "\n" not in str(error.value)

"""lm-evaluation-harness model `sparsetx`: a trained checkpoint answering lm-eval requests in JAX.

Importing this module registers the model (`lm_eval.api.registry.register_model`). lm-eval's CLI
imports only its own model modules, so run it through `python -m sparsetx.tools.lm_eval_cli`, which imports this
module and then hands its arguments to lm-eval's CLI unchanged:

  python -m sparsetx.tools.lm_eval_cli --model sparsetx --model_args workdir=DIR[,step=N] --batch_size 8       --tasks sparsetx_facts_cloze,sparsetx_facts_choice --include_path sparsetx/evaluate/lm_eval_tasks

More: docs/modules.md, sparsetx/evaluate/lm_eval_adapter.py.
"""

from absl import logging
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from sparsetx.evaluate import sampling, scoring
from sparsetx.interp import checkpoint as checkpoint_lib

DEFAULT_BATCH_SIZE = 8


@register_model("sparsetx")
class SparsetxLM(LM):
  """A sparsetx checkpoint: `workdir` (training workdir), `step` (default latest), `batch_size` rows per call."""

  def __init__(
    self,
    workdir: str,
    step: int | None = None,
    batch_size: int | str | None = DEFAULT_BATCH_SIZE,
    max_batch_size=None,
    device=None,
  ):
    super().__init__()
    del max_batch_size, device  # lm-eval passes them to every model; one JAX device is used
    self.config, model, self.step = checkpoint_lib.load(workdir, None if step is None else int(step))
    self.vocabulary = checkpoint_lib.vocabulary(self.config)
    self.max_len = self.config.model.max_len
    rows = int(batch_size) if str(batch_size).isdigit() and int(batch_size) > 0 else DEFAULT_BATCH_SIZE  # 'auto'
    self.scorer = scoring.Scorer(model.model, model.params, self.max_len, rows)
    self.sampler = sampling.Sampler(model.model, model.params, self.max_len, rows, eos_id=self.vocabulary.eos_id)

  def encode(self, text: str) -> list[int]:
    return list(self.vocabulary.encode(text)) if text else []

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(start token + context ids, continuation ids); the context's trailing spaces move to the continuation."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = self.encode(context)
    whole_ids = self.encode(context + continuation)
    if whole_ids[: len(context_ids)] != context_ids:  # a merge across the boundary (subword vocabularies)
      return [checkpoint_lib.START_ID] + context_ids, self.encode(continuation)
    return [checkpoint_lib.START_ID] + context_ids, whole_ids[len(context_ids) :]

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    return self.scorer.loglikelihood([self.encode_pair(*request.args) for request in requests])

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    texts = [self.encode(request.args[0]) for request in requests]
    return self.scorer.loglikelihood_rolling(texts, prefix_id=checkpoint_lib.START_ID)

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Samples (greedy unless do_sample / temperature say otherwise) and cuts at the first `until` string."""
    out = [None] * len(requests)
    groups = {}
    for i, request in enumerate(requests):
      context, kwargs = request.args
      kwargs = dict(kwargs or {})
      until = kwargs.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      max_new = int(kwargs.pop("max_gen_toks", self.max_len // 2))
      if max_new >= self.max_len:
        logging.warning(
          "max_gen_toks=%d does not fit the model's window of %d tokens; generating %d.",
          max_new,
          self.max_len,
          self.max_len - 1,
        )
        max_new = self.max_len - 1
      sample = kwargs.pop("do_sample", None)
      temperature = float(kwargs.pop("temperature", 0.0)) if sample is not False else 0.0
      key = (max_new, temperature, int(kwargs.pop("top_k", 0) or 0), int(kwargs.pop("seed", 0) or 0))
      groups.setdefault(key, []).append((i, checkpoint_lib.encode_prompt(self.vocabulary, context), until))
    for (max_new, temperature, top_k, seed), items in groups.items():
      generated = self.sampler.generate([prompt for _, prompt, _ in items], max_new, temperature, top_k, seed)
      for (i, _, until), ids in zip(items, generated):
        text = self.vocabulary.decode(ids)
        for stop in until:
          if stop and stop in text:
            text = text[: text.index(stop)]
        out[i] = text
    return out

  def get_model_info(self) -> dict:
    return dict(model_num_parameters=None, model_dtype="float32", model_revision=str(self.step), model_sha="")

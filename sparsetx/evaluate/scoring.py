"""Log-likelihood of token continuations given contexts, batched, as lm-evaluation-harness defines it.

A request is `(context_ids, continuation_ids)`; the scored row is `context + continuation`, the
model reads `row[:-1]` and predicts `row[1:]`, and only the continuation's predictions count. A row
longer than the model's window (`max_len` inputs) loses its oldest context tokens, so the last
`max_len + 1` tokens are kept; a continuation must fit in the window. Rows are right-padded to
`max_len` with segment id 0 (attention never reads across segments, so padding changes nothing)
and requests are grouped in batches of a fixed size: one compiled program per (batch, max_len).

More: docs/modules.md, sparsetx/evaluate/scoring.py.
"""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparsetx import config as config_lib


def _row_scores(model, params, inputs_BT, targets_BT, segment_ids_BT, weights_BT):
  """(sum of target log-probs where weight 1, whether every weighted target is the argmax) per row."""
  positions_BT = jnp.broadcast_to(jnp.arange(inputs_BT.shape[1]), inputs_BT.shape)
  logits_BTV = model.apply({"params": params}, inputs_BT, positions_BT, segment_ids_BT)
  logprobs_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  target_BT = jnp.take_along_axis(logprobs_BTV, targets_BT[..., None], axis=-1)[..., 0]
  greedy_BT = jnp.argmax(logprobs_BTV, axis=-1) == targets_BT
  return (target_BT * weights_BT).sum(-1), jnp.all(greedy_BT | (weights_BT == 0), axis=-1)


class Scorer:
  """Scores (context, continuation) token-id requests with one model; `max_len` is the window."""

  def __init__(self, model, params, max_len: int, batch_size: int = 8):
    self.model, self.params, self.max_len, self.batch_size = model, params, max_len, batch_size
    self._scores = jax.jit(functools.partial(_row_scores, model))

  def _row(self, context: Sequence[int], continuation: Sequence[int]):
    """(inputs, targets, number of continuation targets at the end); an empty continuation scores 0."""
    if not context:
      raise config_lib.ConfigError(
        "a log-likelihood request has no context token; start it with id 0 (the start token)."
      )
    if len(continuation) > self.max_len:
      raise config_lib.ConfigError(
        f"a continuation of {len(continuation)} tokens does not fit the model's window of {self.max_len}; "
        "score it with loglikelihood_rolling or split it."
      )
    row = (list(context) + list(continuation))[-(self.max_len + 1) :]
    return row[:-1], row[1:], len(continuation)

  def loglikelihood(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
    """(log-probability of the continuation, whether greedy decoding produces it) per request."""
    rows = [self._row(context, continuation) for context, continuation in requests]
    results = []
    B, T = self.batch_size, self.max_len
    for start in range(0, len(rows), B):
      chunk = rows[start : start + B]
      inputs, targets, segments = (np.zeros((B, T), np.int32) for _ in range(3))
      weights = np.zeros((B, T), np.float32)
      for b, (row_inputs, row_targets, n) in enumerate(chunk):
        L = len(row_inputs)
        inputs[b, :L], targets[b, :L], segments[b, :L] = row_inputs, row_targets, 1
        weights[b, L - n : L] = 1.0
      sums, greedy = jax.device_get(self._scores(self.params, inputs, targets, segments, weights))
      results += [(float(sums[b]), bool(greedy[b])) for b in range(len(chunk))]
    return results

  def loglikelihood_rolling(self, texts: Sequence[Sequence[int]], prefix_id: int = 0) -> list[float]:
    """Log-probability of each whole token sequence given `prefix_id`, scored in rolling windows."""
    windows, owners = [], []
    for i, tokens in enumerate(texts):
      for window in rolling_windows(list(tokens), prefix_id, self.max_len):
        windows.append(window)
        owners.append(i)
    totals = [0.0] * len(texts)
    for owner, (logprob, _) in zip(owners, self.loglikelihood(windows)):
      totals[owner] += logprob
    return totals


def rolling_windows(tokens: list[int], prefix_id: int, max_len: int) -> list[tuple[list[int], list[int]]]:
  """Disjoint (context, continuation) windows that predict each token of `tokens` exactly once.

  Each window predicts the next (up to) `max_len` tokens; its inputs are the `max_len` tokens before
  its last prediction (fewer only in the first window, which starts from `prefix_id`), so every
  prediction has as much context as the window allows. Same windows as lm-eval's, made disjoint.
  """
  windows, done = [], 0
  padded = [prefix_id] + tokens  # padded[j] is the input that predicts tokens[j]
  while done < len(tokens):
    end = min(done + max_len, len(tokens))
    first_input = max(0, end - max_len)
    windows.append((padded[first_input : done + 1], tokens[done:end]))
    done = end
  return windows

"""NIE edge cases (sparsetx/interp/nie.py): a position set no prompt holds, and no pair above the total-effect
threshold, give "n/a" with the reason, never NaN or a +0.000 that patched nothing."""

import numpy as np
import seqio
from interp_cases import random_model

from sparsetx.interp import nie


def test_an_empty_position_set_is_na_with_the_positions_that_exist():
  """As with a BPE vocabulary, where "was" is the token before the last one: no "was" positions at all."""
  model = random_model("sgatlin", n_layers=1)
  pairs = nie.fact_pairs(seqio.ByteVocabulary())
  pairs.masks["was"][:] = False
  result = nie.run(model, pairs, min_effect=1e-3)
  assert result.kept_B.any()
  was = result.col_labels.index("was")
  assert np.isnan(result.nie_RC[:, was]).all() and np.isnan(result.per_pair_RCB[:, was]).all()
  others = [c for c in range(len(result.col_labels)) if c != was]
  assert np.isfinite(result.nie_RC[:, others]).all()
  kept = int(result.kept_B.sum())
  assert result.reasons == [
    f"n/a in column was: the prompts of the {kept} kept pairs have no was position (this "
    "vocabulary's prompts hold noun_first, noun_last, last, all)"
  ]
  table = nie.format_table(result)
  assert "nan" not in table.lower()
  for line in table.splitlines()[2:4]:  # the layer row and "all": n/a in the was column only
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[1 + was] == "n/a" and all(cells[1 + c] != "n/a" for c in others)
  assert table.endswith(result.reasons[0])


def test_no_pair_above_the_threshold_is_na_everywhere_with_the_count():
  B = 5
  masks = {name: np.ones((B, 4), bool) for name in nie.POSITION_SETS}
  pairs = nie.PromptPairs(*(np.zeros((B, 4), np.int32),) * 4, np.zeros(B), np.ones(B), masks, [])
  reasons = nie.na_reasons(pairs, np.zeros(B, bool), 0.5)
  assert reasons == [
    "n/a everywhere: 0 of 5 pairs have a total effect |m(x_patch) - m(x_clean)| of at least 0.5 "
    "logits (min_effect); the model does not yet tell the facts apart, or lower min_effect."
  ]
  result = nie.NieResult(
    ["0", "all"],
    list(nie.POSITION_SETS),
    np.full((2, 5), np.nan),
    np.full((2, 5, B), np.nan),
    np.zeros(B),
    np.full(B, 0.1),
    np.zeros(B, bool),
    {},
    reasons=reasons,
    min_effect=0.5,
  )
  table = nie.format_table(result)
  assert table.splitlines()[2] == "| 0 | n/a | n/a | n/a | n/a | n/a |" and "nan" not in table.lower()
  assert "0 of 5 pairs have a total effect |m(x_patch) - m(x_clean)| of at least 0.5 logits" in table
  assert table.endswith(reasons[0])

"""An export behaves in transformers as its users expect: the tokenizer files load as a standard fast tokenizer with
no prompt and no custom code, and generate() runs the same with or without an attention mask (id 0 both starts
documents and pads), with no warning about max_length."""

import builtins
import logging
import warnings

import numpy as np
import pytest
from export_checks import random_params
from test_export_custom import case_config

from sparsetx.hf import export

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def refuse_prompts(monkeypatch):
  def no_input(prompt=""):
    raise AssertionError(f"transformers asked: {prompt!r}")

  monkeypatch.setattr(builtins, "input", no_input)


def test_the_tokenizer_loads_plainly_and_generate_needs_no_mask(tmp_path, monkeypatch, caplog):
  config = case_config("sgatlin")
  out = tmp_path / "hf"
  export.write_hf(config, random_params(config.model), str(out))
  refuse_prompts(monkeypatch)

  tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(out)  # tokenizer.json: no custom code
  assert type(tokenizer).__module__.startswith("transformers.")
  encoded = tokenizer("The ball was", return_tensors="pt")
  assert encoded["input_ids"][0].tolist() == [0, *(b + 3 for b in b"The ball was")]  # sparsetx's byte ids

  model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
  with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
    warnings.simplefilter("always")
    unmasked = model.generate(encoded["input_ids"], max_new_tokens=6, do_sample=False)
    masked = model.generate(**encoded, max_new_tokens=6, do_sample=False)
  said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
  assert not [s for s in said if "max_length" in s or "attention mask" in s.lower()], said
  np.testing.assert_array_equal(unmasked.numpy(), masked.numpy())  # the start token 0 is not taken for padding

  # The same continuation as the model's own forward, greedily, one token at a time.
  ids = encoded["input_ids"]
  for _ in range(6):
    logits = model(ids).logits
    ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
  np.testing.assert_array_equal(masked.numpy(), ids.numpy())

"""config.data validation: one clear error per mistake, naming the dotted field and the fix."""

import ml_collections
import pytest

from sparsetx import config as config_lib
from sparsetx.data import check_files


def _config(**data):
  config = config_lib.default_config()
  for key, value in data.items():
    config.data[key] = value
  return config


def _text_source(path, **extra):
  return ml_collections.ConfigDict(dict(kind="text", train=str(path), validation="", **extra))


def _error(config) -> str:
  with pytest.raises(config_lib.ConfigError) as info:
    check_files(config_lib.validate(config))
  return str(info.value)


def test_defaults_validate_and_use_the_embedded_mixture():
  config = config_lib.validate(config_lib.default_config())
  assert dict(config.data.mixture) == {"stories": 0.7, "facts": 0.3}
  assert config.data.seq_len == config.model.max_len == 256
  assert config.data.vocab.kind == "byte" and config.data.pack


def test_missing_file(tmp_path):
  config = _config()
  config.data.sources.web = _text_source(tmp_path / "nope.txt")
  config.data.mixture = (("web", 1.0),)
  message = _error(config)
  assert "config.data.sources.web.train" in message and "nope.txt" in message and "no file matches" in message


def test_empty_file(tmp_path):
  (tmp_path / "empty.txt").write_text("")
  (tmp_path / "full.txt").write_text("hello\n")
  config = _config()
  config.data.sources.web = _text_source(tmp_path / "full.txt")
  config.data.sources.web.validation = str(tmp_path / "*.txt")
  config.data.mixture = (("web", 1.0),)
  message = _error(config)
  assert "config.data.sources.web.validation" in message and "empty.txt" in message and "is empty" in message


def test_unknown_task():
  message = _error(_config(mixture=(("stories", 1.0), ("wiki", 1.0))))
  assert "config.data.mixture" in message and "'wiki'" in message and "config.data.sources.wiki" in message


@pytest.mark.parametrize("rate", [0.0, -0.5])
def test_mixture_rate_not_positive(rate):
  message = _error(_config(mixture=(("stories", 0.7), ("facts", rate))))
  assert "config.data.mixture rate for 'facts'" in message and "positive" in message


def test_mixture_rate_not_finite():
  message = _error(_config(mixture=(("stories", 0.7), ("facts", float("nan")))))
  assert message.startswith("config.data.mixture[1][1]=nan is not a finite number")


@pytest.mark.parametrize("seq_len", [0, -4])
def test_sequence_length_not_positive(seq_len):
  message = _error(_config(seq_len=seq_len))
  assert message.startswith(f"config.data.seq_len={seq_len}") and "positive integer" in message


def test_sequence_length_beyond_model_context():
  message = _error(_config(seq_len=512))
  assert "config.data.seq_len=512" in message and "config.model.max_len=256" in message


def test_byte_vocabulary_larger_than_model_vocab():
  config = _config()
  config.model.vocab_size = 200
  message = _error(config)
  assert "config.model.vocab_size=200" in message and "config.data.vocab.kind='byte'" in message


def test_source_and_vocab_mistakes(tmp_path):
  config = _config()
  config.data.sources.web = ml_collections.ConfigDict(dict(kind="csv", train="x"))
  assert "config.data.sources.web.kind='csv' is unknown" in _error(config)
  config = _config()
  config.data.sources.stories = _text_source(tmp_path)
  assert "config.data.sources.stories" in _error(config) and "built-in" in _error(config)
  message = _error(_config(vocab=dict(kind="sentencepiece", path=str(tmp_path / "spm.model"))))
  assert "config.data.vocab.path=" in message and "python -m sparsetx.tools.build_vocab" in message
  assert "config.data.mixture lists task 'facts' twice" in _error(_config(mixture=(("facts", 1.0), ("facts", 2.0))))

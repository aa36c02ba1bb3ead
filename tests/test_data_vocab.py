"""Vocabularies: byte-level by default; a SentencePiece model from tools/build_vocab.py round-trips text."""

import pathlib
import subprocess
import sys

import pytest
import seqio

from sparsetx import config as config_lib
from sparsetx.data import vocab

REPO = pathlib.Path(__file__).resolve().parents[1]
TEXTS = (
    "The ball was red.",
    "Once upon a time, there was a little cat named Lily.",
    "Tom counted 1234 stars — naïve café, 日本語!  Two  spaces, tab\there.",
)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> str:
  """A 400-piece BPE trained by the tool on 3,000 documents of the embedded corpus."""
  output = tmp_path_factory.mktemp("spm") / "tiny"
  result = subprocess.run(
      [sys.executable, str(REPO / "tools" / "build_vocab.py"), f"--output={output}", "--vocab_size=400",
       "--max_documents=3000"],
      capture_output=True, text=True, check=False, timeout=120)
  assert result.returncode == 0, result.stderr
  assert f"wrote {output}.model (400 pieces)" in result.stdout
  return f"{output}.model"


def test_byte_vocabulary_is_the_default_and_fits_the_model():
  vocabulary = vocab.make_vocabulary(config_lib.default_config().data, model_vocab_size=512)
  assert isinstance(vocabulary, seqio.ByteVocabulary)
  assert vocabulary.vocab_size == config_lib.BYTE_VOCAB_SIZE
  for text in TEXTS:
    assert vocabulary.decode(vocabulary.encode(text)) == text


def test_sentencepiece_from_build_vocab_round_trips_text(spm_model):
  data = config_lib.default_config().data
  data.vocab = dict(kind="sentencepiece", path=spm_model)
  vocabulary = vocab.make_vocabulary(data, model_vocab_size=512)
  assert isinstance(vocabulary, seqio.SentencePieceVocabulary)
  assert (vocabulary.vocab_size, vocabulary.pad_id, vocabulary.eos_id, vocabulary.unk_id) == (400, 0, 1, 2)
  for text in TEXTS:
    ids = vocabulary.encode(text)
    assert 0 not in ids and vocabulary.decode(ids) == text
    assert vocabulary.decode_tf(vocabulary.encode_tf(text)).numpy().decode() == text
  # BPE merges learnt from the corpus: a story sentence takes far fewer pieces than bytes.
  assert len(vocabulary.encode(TEXTS[1])) < len(TEXTS[1].encode()) / 2


def test_vocabulary_larger_than_the_model_names_both_fields(spm_model):
  data = config_lib.default_config().data
  data.vocab = dict(kind="sentencepiece", path=spm_model)
  with pytest.raises(config_lib.ConfigError, match=r"config\.data\.vocab .*400 ids.*config\.model\.vocab_size=300"):
    vocab.make_vocabulary(data, model_vocab_size=300)


def test_not_a_sentencepiece_file(tmp_path):
  bogus = tmp_path / "bogus.model"
  bogus.write_text("not a model")
  data = config_lib.default_config().data
  data.vocab = dict(kind="sentencepiece", path=str(bogus))
  with pytest.raises(config_lib.ConfigError, match="is not a SentencePiece model"):
    vocab.make_vocabulary(data)


def test_build_vocab_rejects_a_missing_input(tmp_path):
  result = subprocess.run(
      [sys.executable, str(REPO / "tools" / "build_vocab.py"), f"--output={tmp_path / 'x'}",
       f"--input={tmp_path / 'missing.txt'}"],
      capture_output=True, text=True, check=False, timeout=60)
  assert result.returncode == 2
  assert "--input=" in result.stderr and "missing.txt" in result.stderr and "matches no file" in result.stderr

"""Vocabularies: byte-level by default; SentencePiece and GPT-2 BPE files from sparsetx.tools.build_vocab round-trip text."""

import json
import pathlib
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
import seqio
import tensorflow as tf
import tokenizers

from sparsetx import config as config_lib
from sparsetx.data import check_files, corpus, encoders, vocab

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
    [
      sys.executable,
      "-m",
      "sparsetx.tools.build_vocab",
      f"--output={output}",
      "--vocab_size=400",
      "--max_documents=3000",
    ],
    capture_output=True,
    text=True,
    check=False,
    cwd=REPO,
    timeout=120,
  )
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
    [
      sys.executable,
      "-m",
      "sparsetx.tools.build_vocab",
      f"--output={tmp_path / 'x'}",
      f"--input={tmp_path / 'missing.txt'}",
    ],
    capture_output=True,
    text=True,
    check=False,
    cwd=REPO,
    timeout=60,
  )
  assert result.returncode == 2
  assert "--input=" in result.stderr and "missing.txt" in result.stderr and "matches no file" in result.stderr


# GPT-2 byte-level BPE (config.data.vocab.kind='gpt2') from files that sparsetx.tools.build_vocab writes.

GPT2_TEXTS = TEXTS + (" leading space", "  two leading, trailing  ", "Lily's dog said: \"Hi!\" 'twas 3.5°C ☃ 🐈")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> pathlib.Path:
  """A 400-token byte-level BPE in GPT-2's format, trained by the tool on 3,000 documents of the embedded corpus."""
  output = tmp_path_factory.mktemp("gpt2") / "bpe"
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "sparsetx.tools.build_vocab",
      "--kind=gpt2",
      f"--output={output}",
      "--vocab_size=400",
      "--max_documents=3000",
    ],
    capture_output=True,
    text=True,
    check=False,
    cwd=REPO,
    timeout=120,
  )
  assert result.returncode == 0, result.stderr
  assert f"wrote {output}/vocab.json and merges.txt (400 tokens" in result.stdout
  return output


def gpt2_data(path) -> ml_collections.ConfigDict:
  data = config_lib.default_config().data
  data.vocab = dict(kind="gpt2", path=str(path))
  return data


def reference_ids(path: pathlib.Path, text: str) -> list[int]:
  """`tokenizers`' own GPT-2 tokenizer over the same files (byte-level, no prefix space)."""
  reference = tokenizers.ByteLevelBPETokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
  return reference.encode(text).ids


def test_gpt2_bpe_round_trips_and_matches_tokenizers_on_both_paths(gpt2_dir):
  vocabulary = vocab.make_vocabulary(gpt2_data(gpt2_dir), model_vocab_size=512)
  assert isinstance(vocabulary, vocab.Gpt2BpeVocabulary)
  assert (vocabulary.vocab_size, vocabulary.pad_id, vocabulary.eos_id, vocabulary.unk_id) == (400, 0, 1, None)
  for text in GPT2_TEXTS:
    ids = vocabulary.encode(text)
    assert ids == reference_ids(gpt2_dir, text)
    assert 0 not in ids and vocabulary.decode(ids) == text
    assert vocabulary.encode_tf(tf.constant(text)).numpy().tolist() == ids
    assert vocabulary.decode_tf(tf.constant(ids + [vocabulary.eos_id, 5, 6])).numpy().decode() == text  # up to EOS
  ragged = vocabulary.encode_tf(tf.constant(GPT2_TEXTS[:2]))
  assert ragged.to_list() == [vocabulary.encode(t) for t in GPT2_TEXTS[:2]]
  assert len(vocabulary.encode(TEXTS[1])) < len(TEXTS[1].encode()) / 2  # merges learnt from the corpus


def test_gpt2_files_without_a_pad_token_move_id_0_out_of_padding(gpt2_dir, tmp_path):
  """GPT-2's own layout gives id 0 to '!': it moves to id n, all other ids stay tokenizers' ids."""
  table = json.loads((gpt2_dir / "vocab.json").read_text())
  table["<pad>"], table["!"] = table["!"], 0
  (tmp_path / "vocab.json").write_text(json.dumps(table))
  (tmp_path / "merges.txt").write_text((gpt2_dir / "merges.txt").read_text())
  vocabulary = vocab.make_vocabulary(gpt2_data(tmp_path), model_vocab_size=512)
  assert vocabulary.vocab_size == 401 and vocabulary.encode("!") == [400]
  for text in GPT2_TEXTS:
    ids = vocabulary.encode(text)
    assert ids == [400 if i == 0 else i for i in reference_ids(tmp_path, text)]
    assert 0 not in ids and vocabulary.decode(ids) == text
  # The same vocabulary as one tokenizer.json file: same ids.
  tokenizer_json = tmp_path / "tokenizer.json"
  tokenizers.ByteLevelBPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")).save(str(tokenizer_json))
  from_json = vocab.make_vocabulary(gpt2_data(tokenizer_json))
  assert [from_json.encode(t) for t in GPT2_TEXTS] == [vocabulary.encode(t) for t in GPT2_TEXTS]


def moved_id_0_files(gpt2_dir, directory):
  """GPT-2's own layout: id 0 is '!', not padding (the vocabulary moves it)."""
  table = json.loads((gpt2_dir / "vocab.json").read_text())
  table["<pad>"], table["!"] = table["!"], 0
  directory.mkdir()
  (directory / "vocab.json").write_text(json.dumps(table))
  (directory / "merges.txt").write_text((gpt2_dir / "merges.txt").read_text())
  return directory


def test_each_batch_encoder_gives_the_vocabularys_ids_and_eos(gpt2_dir, spm_model, tmp_path):
  """The tokenize job's native batch encoders (encoders.py) against each vocabulary's own one-text encode."""
  texts = [*TEXTS, *GPT2_TEXTS, "", "!!! ! !", *corpus.stories("validation")[:50]]
  datas = [config_lib.default_config().data, gpt2_data(gpt2_dir), gpt2_data(moved_id_0_files(gpt2_dir, tmp_path / "g"))]
  datas.append(config_lib.default_config().data)
  datas[-1].vocab = dict(kind="sentencepiece", path=spm_model)
  for data in datas:
    vocabulary = vocab.make_vocabulary(data)
    encoded = encoders.batch_encoder(vocabulary)(texts)
    assert [ids.dtype for ids in encoded] == [np.int32] * len(texts)
    assert [ids.tolist() for ids in encoded] == [[*vocabulary.encode(t), vocabulary.eos_id] for t in texts], data.vocab
  assert encoders.batch_encoder(vocabulary)([]) == []


@pytest.mark.parametrize("present,missing", [("vocab.json", "merges.txt"), ("merges.txt", "vocab.json")])
def test_gpt2_missing_file_is_one_clear_error(gpt2_dir, tmp_path, present, missing):
  (tmp_path / present).write_text((gpt2_dir / present).read_text())
  config = config_lib.default_config()
  config.data.vocab = dict(kind="gpt2", path=str(tmp_path))
  for check in (lambda: check_files(config_lib.validate(config)), lambda: vocab.make_vocabulary(config.data)):
    with pytest.raises(config_lib.ConfigError) as error:
      check()
    message = str(error.value)
    assert f"config.data.vocab.path='{tmp_path}' has no {missing}" in message
    assert "vocab.json + merges.txt" in message and "python -m sparsetx.tools.build_vocab --kind=gpt2" in message


def test_gpt2_corrupt_vocab_json_names_the_file(tmp_path):
  (tmp_path / "vocab.json").write_text("{not json")
  (tmp_path / "merges.txt").write_text("#version: 0.2\n")
  with pytest.raises(config_lib.ConfigError, match=r"vocab\.json \+ .*merges\.txt is not a GPT-2 BPE"):
    vocab.make_vocabulary(gpt2_data(tmp_path))


def test_config_refuses_a_model_vocab_smaller_than_the_gpt2_bpe(gpt2_dir):
  config = config_lib.default_config()
  config.data.vocab = dict(kind="gpt2", path=str(gpt2_dir))
  config.model.vocab_size = 384
  with pytest.raises(config_lib.ConfigError, match=r"config\.model\.vocab_size=384 is smaller .*GPT-2 BPE.*400 ids"):
    check_files(config_lib.validate(config))
  config.model.vocab_size = 400
  check_files(config_lib.validate(config))

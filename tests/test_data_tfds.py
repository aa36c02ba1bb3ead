"""The TFDS source kind: a locally prepared dataset (nothing downloaded) reads back exactly; missing: clear errors."""

import collections

import ml_collections
import numpy as np
import pytest
import seqio
import tensorflow_datasets as tfds
from test_tokenize import decoded

from sparsetx import config as config_lib
from sparsetx.data import check_files, pretokenize, sources, tasks

NAME = "sparsetx_tiny_texts"
TEXTS = {
  "train": [f"Story {i}: Lily saw {'ünï' if i % 3 else 'a cat'} near tree {i * 7}." for i in range(40)],
  "validation": [f"Held out {i} — café!" for i in range(5)],
}
SEQ_LEN = 64  # every document + EOS fits one row, so each segment is one whole document
BYTES = seqio.ByteVocabulary()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
  """Prepares NAME:1.0.0 under a temporary data_dir with a builder that is not registered.

  The pipeline then reads the dataset from its files alone, as it would one prepared on another machine.
  """
  with tfds.core.registered.skip_registration():

    class SparsetxTinyTexts(tfds.core.GeneratorBasedBuilder):
      VERSION = tfds.core.Version("1.0.0")

      def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
          builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text(), "index": np.int64})
        )

      def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        return {split: self._generate_examples(split) for split in TEXTS}

      def _generate_examples(self, split):
        for i, text in enumerate(TEXTS[split]):
          yield i, {"text": text, "index": i}

  directory = str(tmp_path_factory.mktemp("tfds"))
  builder = SparsetxTinyTexts(data_dir=directory)
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return directory


def make_config(data_dir: str, **source) -> ml_collections.ConfigDict:
  config = config_lib.default_config()
  config.data.sources.tiny = ml_collections.ConfigDict(
    dict(
      kind="tfds",
      tfds_name=f"{NAME}:1.0.0",
      data_dir=data_dir,
      train="train",
      validation="validation",
      text_field="text",
    )
  )
  config.data.sources.tiny.update(source)
  config.data.update(
    dict(mixture=(("tiny", 1.0),), seq_len=SEQ_LEN, global_batch_size=8, eval_batch_size=8, shuffle_buffer=16)
  )
  return check_files(config_lib.validate(config))


@pytest.mark.parametrize("shards", [1, 2])
def test_the_tokenize_job_reads_each_tfds_split_exactly(data_dir, tmp_path, shards):
  """TFDS goes through the seqio task's TensorFlow reader: every text of each split is in the corpus once."""
  config = make_config(data_dir)
  pretokenize.tokenize_corpus(config, tmp_path / "corpus", shards=shards)
  for split in ("train", "validation"):
    assert collections.Counter(decoded(tmp_path / "corpus", "tiny", split)) == collections.Counter(TEXTS[split])


def test_missing_data_dir_is_one_clear_error(tmp_path):
  with pytest.raises(config_lib.ConfigError, match=r"config\.data\.sources\.tiny\.data_dir=.*is not a directory"):
    make_config(str(tmp_path / "absent"))


def test_missing_dataset_or_split_names_the_field(data_dir):
  source = ml_collections.ConfigDict(
    dict(kind="tfds", tfds_name="sparsetx_absent_texts:1.0.0", data_dir=data_dir, train="train")
  )
  with pytest.raises(config_lib.ConfigError) as error:
    sources.make_source("tiny", source)
  message = str(error.value)
  assert "config.data.sources.tiny.tfds_name='sparsetx_absent_texts:1.0.0' is not a prepared TFDS dataset" in message
  assert NAME in message and "nothing is downloaded" in message and "\n" not in message
  source.update(dict(tfds_name=f"{NAME}:1.0.0", validation="valid"))
  with pytest.raises(config_lib.ConfigError, match=r"validation='valid' is not a split .*train, validation"):
    sources.make_source("tiny", source)


def test_unknown_text_field_names_the_features(data_dir):
  config = make_config(data_dir, text_field="body")
  with pytest.raises(ValueError, match=r"text_field='body' is not a feature.*\['index', 'text'\]"):
    tasks.register_mixture(config.data, BYTES).get_dataset({"targets": SEQ_LEN}, split="train")

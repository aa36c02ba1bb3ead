"""Vocabularies: byte-level by default (no files), SentencePiece from a local model file.

Both follow seqio's id conventions (pad=0, eos=1, unk=2), which the packer relies on: it
treats 0 as padding. `tools/build_vocab.py` trains a SentencePiece model with these ids.
"""

import ml_collections
import seqio
import tensorflow as tf

from sparsetx import config as config_lib


def make_vocabulary(data: ml_collections.ConfigDict, model_vocab_size: int | None = None) -> seqio.Vocabulary:
  """The vocabulary named by `config.data.vocab`; refuses one larger than the model's embedding.

  Args:
    data: `config.data`.
    model_vocab_size: `config.model.vocab_size`; when given, the vocabulary must fit in it.
  """
  kind, path = data.vocab.kind, data.vocab.path
  if kind == "byte":
    vocabulary = seqio.ByteVocabulary()
  elif kind == "sentencepiece":
    if not path or not tf.io.gfile.exists(path):
      raise config_lib.ConfigError(
          f"config.data.vocab.path={path!r} is not a file; build one with tools/build_vocab.py."
      )
    vocabulary = seqio.SentencePieceVocabulary(path)
    try:
      vocabulary.vocab_size  # loads the model now, so a corrupt file fails here with its name
    except Exception as error:  # sentencepiece raises plain RuntimeError/OSError on a bad proto
      raise config_lib.ConfigError(
          f"config.data.vocab.path={path!r} is not a SentencePiece model ({error}); "
          "rebuild it with tools/build_vocab.py."
      ) from error
  else:
    raise config_lib.ConfigError(
        f"config.data.vocab.kind={kind!r} is unknown; use one of {', '.join(map(repr, config_lib.DATA_VOCAB_KINDS))}."
    )
  if model_vocab_size is not None and vocabulary.vocab_size > model_vocab_size:
    raise config_lib.ConfigError(
        f"config.data.vocab ({kind}, {vocabulary.vocab_size} ids) is larger than "
        f"config.model.vocab_size={model_vocab_size}; raise config.model.vocab_size to at least "
        f"{vocabulary.vocab_size} or use a smaller vocabulary."
    )
  return vocabulary

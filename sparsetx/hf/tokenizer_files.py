"""Hugging Face tokenizer files for the training vocabulary, so an export tokenizes as training did.

More: docs/modules.md, sparsetx/hf/tokenizer_files.py.
"""

import json
import os
import shutil

import ml_collections
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from sparsetx import config as config_lib

BYTE_OFFSET = 3  # seqio.ByteVocabulary: ids 0, 1, 2 are pad, eos, unk
PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
GPT2_PAD = "<pad>"  # the name of id 0 when GPT-2 files have no padding token there
SPECIAL_IDS = {PAD: 0, EOS: 1, UNK: 2}


def byte_stand_ins() -> list[str]:
  """The printable character the byte-level pre-tokenizer uses for each byte 0..255.

  Printable Latin-1 bytes stand for themselves; the others (controls, space, soft hyphen) take
  the code points from 256 upwards, in byte order. This is the byte-level convention of
  `tokenizers.pre_tokenizers.ByteLevel`, which `byte_level_tokenizer` checks against its alphabet.
  """
  printable = (
    set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
  )
  stand_ins, extra = [], 0
  for b in range(256):
    if b in printable:
      stand_ins.append(chr(b))
    else:
      stand_ins.append(chr(256 + extra))
      extra += 1
  return stand_ins


def _padding_first(pad: str) -> processors.TemplateProcessing:
  """The post-processor of every kind: id 0 (the padding token `pad`) first, as each packed training row starts."""
  return processors.TemplateProcessing(single=f"{pad} $A", pair=f"{pad} $A {pad} $B", special_tokens=[(pad, 0)])


def byte_level_tokenizer() -> tokenizers.Tokenizer:
  """A `tokenizers.Tokenizer` whose ids are exactly seqio.ByteVocabulary's."""
  stand_ins = byte_stand_ins()
  if set(stand_ins) != set(pre_tokenizers.ByteLevel.alphabet()):
    raise RuntimeError("tokenizers' byte-level alphabet changed; the byte vocabulary cannot be exported exactly.")
  vocab = dict(SPECIAL_IDS)
  vocab.update({char: b + BYTE_OFFSET for b, char in enumerate(stand_ins)})
  tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.add_special_tokens([PAD, EOS, UNK])
  tokenizer.post_processor = _padding_first(PAD)
  return tokenizer


def gpt2_tokenizer(path: str) -> tuple[tokenizers.Tokenizer, str, str]:
  """(tokenizer in sparsetx's ids, padding token, EOS token) of the GPT-2 BPE files at `path`."""
  from sparsetx.data import bpe_vocab

  bpe = bpe_vocab.load(path)
  spec = json.loads(bpe.tokenizer.to_str())
  if bpe.moved_id is None:
    pad = bpe.tokenizer.id_to_token(0)
  else:  # the files' id 0 moves to the end and id 0 becomes padding
    model_ids = lambda i: bpe.moved_id if i == 0 else i  # noqa: E731
    spec["model"]["vocab"] = {token: model_ids(i) for token, i in spec["model"]["vocab"].items()}
    for added in spec["added_tokens"]:
      added["id"] = model_ids(added["id"])
    pad = GPT2_PAD
    spec["model"]["vocab"][pad] = 0  # a model-vocabulary entry no merge reaches: text never encodes to it
  tokenizer = tokenizers.Tokenizer.from_str(json.dumps(spec))
  tokenizer.post_processor = _padding_first(pad)
  return tokenizer, pad, bpe_vocab.EOS_TOKEN


def sentencepiece_tokenizer(path: str) -> tuple[tokenizers.Tokenizer, tuple[str, str, str]]:
  """(tokenizer encoding like seqio.SentencePieceVocabulary, its (pad, eos, unk) pieces) of a .model file.

  transformers' converter follows the model's own normalizer spec (dummy prefix, whitespace escaping,
  byte fallback, merges ranked by piece score), which is what makes the ids equal.
  """
  from sentencepiece import sentencepiece_model_pb2
  from transformers.convert_slow_tokenizer import SpmConverter

  proto = sentencepiece_model_pb2.ModelProto()
  with open(path, "rb") as f:
    proto.ParseFromString(f.read())
  pieces = [piece.piece for piece in proto.pieces]
  if proto.trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.BPE:
    vocab = {piece: i for i, piece in enumerate(pieces)}
  else:
    # Known difference: a unigram lattice can match the literal spelling of a control piece ("<pad>" typed
    # in text), which SentencePiece never does. BPE models (sparsetx/tools/build_vocab.py's default) are exact.
    vocab = [(piece.piece, piece.score) for piece in proto.pieces]
  tokenizer = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
  if tokenizer is None:
    raise config_lib.ConfigError(f"the SentencePiece model {path!r} is neither BPE nor unigram; it has no HF export.")
  pad, eos, unk = pieces[:3]
  tokenizer.add_special_tokens([pad, eos, unk])
  tokenizer.post_processor = _padding_first(pad)
  return tokenizer, (pad, eos, unk)


def _tokenizer_config(max_len: int, bos: str, eos: str, unk: str, pad: str, **extra) -> dict:
  return dict(
    bos_token=bos,
    eos_token=eos,
    unk_token=unk,
    pad_token=pad,
    model_max_length=max_len,
    clean_up_tokenization_spaces=False,
    **extra,
  )


def write(data: ml_collections.ConfigDict, max_len: int, out_dir: str) -> list[str]:
  """Writes the tokenizer files of `config.data.vocab` into `out_dir`; returns the names written."""
  kind = data.vocab.kind
  if kind == "byte":
    byte_level_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
    config = _tokenizer_config(
      max_len, PAD, EOS, UNK, PAD, tokenizer_class="PreTrainedTokenizerFast", split_special_tokens=True
    )  # "<pad>" typed in text is 5 bytes, as in seqio
    names = ["tokenizer.json", "tokenizer_config.json"]
  elif kind == "gpt2":
    tokenizer, pad, eos = gpt2_tokenizer(data.vocab.path)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    # Padding is not named a special token: transformers would then match a literal "<pad>" in text,
    # which sparsetx encodes as ordinary BPE. The post-processor still puts id 0 first.
    config = dict(
      eos_token=eos,
      model_max_length=max_len,
      clean_up_tokenization_spaces=False,
      tokenizer_class="PreTrainedTokenizerFast",
    )
    names = ["tokenizer.json", "tokenizer_config.json"]
  elif kind == "sentencepiece":
    path = data.vocab.path
    if not path or not os.path.isfile(path):
      raise config_lib.ConfigError(
        f"the checkpoint's config.data.vocab.path={path!r} is not a file; the SentencePiece model must be "
        "reachable to export its tokenizer (restore the file at that path)."
      )
    tokenizer, (pad, eos, unk) = sentencepiece_tokenizer(path)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    shutil.copyfile(path, os.path.join(out_dir, "tokenizer.model"))  # what sparsetx's own import reads
    config = _tokenizer_config(
      max_len, pad, eos, unk, pad, tokenizer_class="PreTrainedTokenizerFast", split_special_tokens=True
    )  # SentencePiece never reads control pieces from text
    names = ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
  else:
    raise config_lib.ConfigError(f"config.data.vocab.kind={kind!r} has no Hugging Face tokenizer export.")
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  return names


def vocab_of(hf_dir: str) -> ml_collections.ConfigDict | None:
  """`config.data.vocab` for the tokenizer files in `hf_dir` when sparsetx reads them with the same ids as the
  model's embedding (byte, sentencepiece, gpt2 with padding at 0); None for any other tokenizer."""
  model_file = os.path.join(hf_dir, "tokenizer.model")
  if os.path.isfile(model_file):
    return ml_collections.ConfigDict(dict(kind="sentencepiece", path=os.path.abspath(model_file)))
  json_file = os.path.join(hf_dir, "tokenizer.json")
  if os.path.isfile(json_file):
    with open(json_file) as f:
      saved = json.load(f)
    if saved.get("model", {}).get("vocab") == json.loads(byte_level_tokenizer().to_str())["model"]["vocab"]:
      return ml_collections.ConfigDict(dict(kind="byte", path=""))
    model = saved.get("model", {})
    if model.get("type") == "BPE" and isinstance(model.get("vocab"), dict):
      from sparsetx.data import bpe_vocab

      # sparsetx reads a GPT-2 style tokenizer.json with the file's ids only when id 0 is padding; otherwise
      # it would move id 0 and the ids would no longer index this model's embedding rows.
      first = next((token for token, i in model["vocab"].items() if i == 0), None)
      if first in bpe_vocab.PAD_TOKENS:
        return ml_collections.ConfigDict(dict(kind="gpt2", path=os.path.abspath(json_file)))
  return None

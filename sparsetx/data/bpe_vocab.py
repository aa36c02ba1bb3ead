"""A GPT-2 byte-level BPE read from the user's local files, in sparsetx's id space (tokenizers; no TensorFlow).

Files (`config.data.vocab.path`): a directory holding GPT-2's `vocab.json` + `merges.txt` (as OpenAI and
Hugging Face publish them, or as `python -m sparsetx.tools.build_vocab --kind=gpt2` writes them), or a `tokenizer.json`
file (or a directory holding only that). Nothing is downloaded. Encoding is GPT-2's: text as UTF-8
bytes mapped to printable characters, GPT-2's pre-tokenization regex, no added prefix space, no BOS;
`<|endoftext|>` is the EOS (a literal `<|endoftext|>` in the text also becomes it, as in Hugging Face's
GPT-2 tokenizer).

More: docs/modules.md, sparsetx/data/bpe_vocab.py.
"""

import dataclasses
import functools
import json
import os

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from sparsetx import config as config_lib

EOS_TOKEN = "<|endoftext|>"
PAD_TOKENS = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")
VOCAB_FILE, MERGES_FILE, TOKENIZER_FILE = "vocab.json", "merges.txt", "tokenizer.json"


def vocab_files(path: str, field: str = "config.data.vocab.path") -> tuple[str, ...]:
  """(vocab.json, merges.txt) or (tokenizer.json,) for `path`; a clear error naming what is missing."""
  fix = (
    f"point {field} at a directory holding {VOCAB_FILE} + {MERGES_FILE} or at a {TOKENIZER_FILE} "
    "(python -m sparsetx.tools.build_vocab --kind=gpt2 writes the first)"
  )
  if not path:
    raise config_lib.ConfigError(f"{field} is empty; {fix}.")
  if "://" in path:
    raise config_lib.ConfigError(
      f"{field}={path!r} is remote; GPT-2 BPE files are read locally, so copy them and {fix}."
    )
  path = os.path.expanduser(path)
  if os.path.isfile(path):
    return (path,)
  if not os.path.isdir(path):
    raise config_lib.ConfigError(f"{field}={path!r} does not exist; {fix}.")
  pair = tuple(os.path.join(path, name) for name in (VOCAB_FILE, MERGES_FILE))
  if all(os.path.isfile(p) for p in pair):
    return pair
  if os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
    return (os.path.join(path, TOKENIZER_FILE),)
  missing = " and ".join(os.path.basename(p) for p in pair if not os.path.isfile(p))
  raise config_lib.ConfigError(f"{field}={path!r} has no {missing} (and no {TOKENIZER_FILE}); {fix}.")


def gpt2_byte_level(bpe_model: models.BPE) -> Tokenizer:
  """A tokenizer that splits and joins text as GPT-2's does around `bpe_model`: UTF-8 bytes, GPT-2's regex,
  no prefix space. sparsetx/tools/build_vocab.py --kind=gpt2 trains on it, so its files read back here encode the same."""
  tokenizer = Tokenizer(bpe_model)
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def _gpt2_tokenizer(vocab_path: str, merges_path: str) -> Tokenizer:
  """GPT-2's tokenizer over these files: `gpt2_byte_level` of their BPE, EOS special."""
  tokenizer = gpt2_byte_level(models.BPE.from_file(vocab_path, merges_path))
  if tokenizer.token_to_id(EOS_TOKEN) is not None:
    tokenizer.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])
  return tokenizer


@dataclasses.dataclass(frozen=True, eq=False)
class Gpt2Bpe:
  """The tokenizer of the files and the id mapping described in the module docstring."""

  tokenizer: Tokenizer
  files: tuple[str, ...]
  file_size: int  # ids in the files (max id + 1)
  eos_id: int
  moved_id: int | None  # where the files' id 0 went (file_size), or None when id 0 is padding

  @property
  def vocab_size(self) -> int:
    return self.file_size + (self.moved_id is not None)

  def encode(self, text: str) -> list[int]:
    return self.to_model_ids(self.tokenizer.encode(text, add_special_tokens=False).ids)

  def decode(self, ids) -> str:
    """Text of model ids; padding, EOS and ids outside the vocabulary are skipped."""
    ids_L = np.asarray(ids, np.int64).reshape(-1)
    ids_L = ids_L[(ids_L > 0) & (ids_L < self.vocab_size) & (ids_L != self.eos_id)]
    if self.moved_id is not None:
      ids_L = np.where(ids_L == self.moved_id, 0, ids_L)
    return self.tokenizer.decode(ids_L.tolist(), skip_special_tokens=True)

  def to_model_ids(self, file_ids: list[int]) -> list[int]:
    if self.moved_id is None:
      return list(file_ids)
    return [self.moved_id if i == 0 else i for i in file_ids]


def load(path: str, field: str = "config.data.vocab.path") -> Gpt2Bpe:
  """The GPT-2 BPE of `path` (cached per file set and modification time)."""
  files = vocab_files(path, field)
  return _load(files, tuple(os.path.getmtime(f) for f in files), field)


@functools.lru_cache(maxsize=8)
def _load(files: tuple[str, ...], mtimes: tuple[float, ...], field: str) -> Gpt2Bpe:
  del mtimes  # part of the cache key only: an edited file is read again
  names = " + ".join(files)
  try:
    if len(files) == 2:
      with open(files[0], encoding="utf-8") as f:
        json.load(f)  # tokenizers' own message for a broken vocab.json does not name the file
      tokenizer = _gpt2_tokenizer(*files)
    else:
      tokenizer = Tokenizer.from_file(files[0])
  except Exception as error:  # tokenizers raises plain Exception on malformed files
    raise config_lib.ConfigError(
      f"{field}: {names} is not a GPT-2 BPE ({str(error)[:200]}); use GPT-2's vocab.json + merges.txt or a "
      "tokenizer.json, or rebuild them with python -m sparsetx.tools.build_vocab --kind=gpt2."
    ) from error
  if not isinstance(tokenizer.model, models.BPE):
    raise config_lib.ConfigError(
      f"{field}: {names} holds a {type(tokenizer.model).__name__} model, not a BPE; use a GPT-2 style tokenizer.json."
    )
  tokenizer.no_padding()
  tokenizer.no_truncation()
  eos_id = tokenizer.token_to_id(EOS_TOKEN)
  if eos_id is None:
    raise config_lib.ConfigError(
      f"{field}: {names} has no {EOS_TOKEN} token, which marks the end of each document (EOS); add it "
      "to the vocabulary or rebuild the files with python -m sparsetx.tools.build_vocab --kind=gpt2."
    )
  file_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
  zero_is_padding = tokenizer.id_to_token(0) in PAD_TOKENS
  moved_id = None if zero_is_padding else file_size
  return Gpt2Bpe(tokenizer, files, file_size, moved_id if eos_id == 0 else eos_id, moved_id)

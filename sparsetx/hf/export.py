"""Checkpoints <-> directories in the Hugging Face layout (safetensors + config.json + tokenizer files).

`export` writes a trained model that `transformers` loads: dense GPT-NeoX-block models as `GPTNeoXForCausalLM`
(`hf/neox.py`), every other architecture with its PyTorch modeling files (`hf/custom.py`, `trust_remote_code`).
It reads the parameters one tensor at a time on the host (train/checkpoints/param_reader.py) and writes size-capped shards
(hf/shards.py), one in memory at a time, locally or to gs:// (hf/output.py). `load_hf` reads either kind back into
a config and param tree; `import_hf` writes that as a step-0 checkpoint that `python -m sparsetx.train` continues.
"""

import importlib
import json
import math
import os
import re
import shutil
import time

import jax
import ml_collections
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import traverse_util

from sparsetx import config as config_lib
from sparsetx import paths
from sparsetx.data import check_files
from sparsetx.hf import lazy_tensors, neox, output, shards, tokenizer_files, weight_files
from sparsetx.hf.shards import WEIGHTS, WEIGHTS_INDEX
from sparsetx.models.ffn import selection_bias
from sparsetx.train.checkpoints import param_writer
from sparsetx.train.checkpoints.param_reader import ParamReader

KINDS = ("auto", "neox", "custom")
DTYPES = ("float32", "bfloat16")
ConfigError = config_lib.ConfigError


# ---------------------------------------------------------------------------------------------- choosing the mapping


def _custom_module():
  try:
    return importlib.import_module("sparsetx.hf.custom")
  except ModuleNotFoundError as error:
    if error.name != "sparsetx.hf.custom":
      raise
    raise ConfigError(
      "this model needs the custom export (sparsetx/hf/custom.py), which this installation lacks; "
      "only dense GPT-NeoX-block models (ffn.type='mlp', norm='layernorm', use_bias=True) export here."
    ) from None


def mapping_for(model: ml_collections.ConfigDict, kind: str = "auto"):
  """The module (neox or custom) that converts `model`: `kind` auto picks GPT-NeoX when exact."""
  if kind not in KINDS:
    raise ConfigError(f"--kind={kind!r} is unknown; use one of {', '.join(KINDS)}.")
  reason = neox.unsupported_reason(model)
  if kind == "neox" and reason:
    raise ConfigError(f"--kind=neox: this model is not a GPTNeoXForCausalLM: {reason}; use --kind=auto or custom.")
  if kind == "neox" or (kind == "auto" and reason is None):
    return neox
  custom = _custom_module()
  custom_reason = custom.unsupported_reason(model)
  if custom_reason:
    raise ConfigError(f"this model cannot be exported: {custom_reason}.")
  return custom


# ---------------------------------------------------------------------------------------------- writing directories


def _inside(path: str, directory: str) -> bool:
  path, directory = os.path.realpath(path), os.path.realpath(directory)
  return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _write_json(path: str, value: dict) -> None:
  with open(path, "w") as f:
    json.dump(value, f, indent=2, sort_keys=True)
    f.write("\n")


def write_hf(
  config: ml_collections.ConfigDict,
  params,
  out_dir: str,
  overwrite: bool = False,
  kind: str = "auto",
  dtype: str = "float32",
  max_shard_size: str | int = shards.MAX_SHARD_SIZE,
) -> str:
  """Writes `params` (in memory) of `config`'s model as an HF directory at `out_dir`; returns the mapping used."""
  return _write(
    config,
    lazy_tensors.tree_reader(params),
    lazy_tensors.tree_shapes(params),
    out_dir,
    overwrite,
    kind,
    dtype,
    max_shard_size,
  )["kind"]


def _write(config, read, source_shapes: dict, out_dir: str, overwrite, kind, dtype, max_shard_size) -> dict:
  """The one writer: tensors made one at a time from `read`, in shards of at most `max_shard_size` bytes; returns
  the kind, the shards, the weights' bytes and the seconds spent reading (and making) and writing them."""
  if dtype not in DTYPES:
    raise ConfigError(f"--dtype={dtype!r} is unknown; use one of {', '.join(DTYPES)}.")
  cap = shards.parse_size(max_shard_size)
  mapping = mapping_for(config.model, kind)
  output.check_target(out_dir, overwrite, "--out", "config.json")
  _check_sources(config.model, source_shapes)
  config_json, tensors = mapping.hf_tensors(config.model)
  config_json = dict(config_json, dtype=dtype, torch_dtype=dtype)  # torch_dtype: the transformers 4.x name
  sizes = {
    name: math.prod(shape) * np.dtype(_stored_dtype(name, dtype)).itemsize
    for name, shape in lazy_tensors.shapes(tensors, source_shapes).items()
  }
  files = shards.plan(sizes, cap)
  with (
    paths.writing(f"writing {out_dir}", f"nothing was left there; {paths.FREE_SPACE}"),
    output.open_output(out_dir, first_removed=(WEIGHTS_INDEX, WEIGHTS), stale=_SHARD.fullmatch) as out,
  ):
    out.put(lambda directory: _write_small_files(config, mapping, config_json, directory))
    seconds = dict(read_seconds=0.0, write_seconds=0.0)
    for file, names in files.items():  # one shard's tensors in memory at a time
      began = time.perf_counter()
      shard = _made(tensors, names, read, dtype)
      made = time.perf_counter()
      out.put(lambda directory, f=file, a=shard: safetensors.numpy.save_file(a, os.path.join(directory, f), _FORMAT))
      seconds["read_seconds"] += made - began
      seconds["write_seconds"] += time.perf_counter() - made
      del shard
    if len(files) > 1:  # last: an index names only shards already written
      out.put(lambda directory: _write_json(os.path.join(directory, WEIGHTS_INDEX), shards.index(files, sizes)))
  kind = "hf_" + mapping.__name__.rsplit(".", 1)[-1]  # the export kind: hf_neox | hf_custom
  return dict(kind=kind, shards=len(files), bytes=sum(sizes.values()), **seconds)


_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
_FORMAT = {"format": "pt"}  # transformers refuses safetensors files without a known format
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _stored_dtype(name: str, dtype: str):
  """The numpy dtype tensor `name` is written in: the export's, but a selection bias stays float32 as the model holds
  it (models/ffn/selection_bias.py): rounded to bf16 it would move by about one update and change near-tied picks."""
  return np.float32 if name.rsplit(".", 1)[-1] == selection_bias.NAME else _NUMPY_DTYPES[dtype]


def _made(tensors: dict, names: list[str], read, dtype: str) -> dict[str, np.ndarray]:
  """The tensors `names` of one shard: their sources read together (in parallel), each source dropped once its
  tensor is made, so a transform (neox's fused QKV) adds one tensor, not a shard."""
  arrays = read(list(dict.fromkeys(path for name in names for path in tensors[name].sources)))
  shard = {}
  for name in names:
    shard[name] = lazy_tensors.made(tensors[name], arrays).astype(_stored_dtype(name, dtype), copy=False)
    for path in tensors[name].sources:
      arrays.pop(path, None)
  return shard


def _check_sources(model: ml_collections.ConfigDict, source_shapes: dict) -> None:
  """One sentence when the parameters are not the ones the model config builds (names or shapes)."""
  expected = lazy_tensors.param_shapes(model)
  for path in sorted(set(expected) | set(source_shapes)):
    if expected.get(path) != source_shapes.get(path):
      raise ConfigError(
        f"the parameters do not match the model of the config: {'/'.join(path)} has shape "
        f"{source_shapes.get(path, 'none (missing)')} where the model builds {expected.get(path, 'none')}; "
        "export the parameters with the config they were trained with."
      )


def _write_small_files(config, mapping, config_json: dict, directory: str) -> None:
  """config.json, generation_config.json, the modeling files of a custom export, the tokenizer files."""
  _write_json(os.path.join(directory, "config.json"), config_json)
  # generate() fills finished rows with pad_token_id and, given no attention_mask, masks every input equal to it
  # unless it is the EOS: id 0 pads but also starts every document, so EOS stands in (as GPT-2's exports do) and a
  # prompt without a mask runs as with one. No max_length: transformers warns when max_new_tokens overrides it.
  _write_json(
    os.path.join(directory, "generation_config.json"),
    dict(
      bos_token_id=config_json["bos_token_id"],
      eos_token_id=config_json["eos_token_id"],
      pad_token_id=config_json["eos_token_id"],
    ),
  )
  for path in getattr(mapping, "MODELING_FILES", ()):
    shutil.copyfile(path, os.path.join(directory, os.path.basename(path)))
  tokenizer_files.write(config.data, config.model.max_len, directory)


def export(
  workdir: str,
  out_dir: str,
  step: int | None = None,
  overwrite: bool = False,
  kind: str = "auto",
  dtype: str = "float32",
  max_shard_size: str | int = shards.MAX_SHARD_SIZE,
) -> dict:
  """Exports the checkpoint at `step` (default: latest) of `workdir` to `out_dir` (local or gs://), reading the
  parameters one tensor at a time on the host; returns a summary."""
  if kind not in KINDS:
    raise ConfigError(f"--kind={kind!r} is unknown; use one of {', '.join(KINDS)}.")
  shards.parse_size(max_shard_size)
  if not paths.is_remote(out_dir) and _inside(workdir, out_dir):
    raise ConfigError(f"--out={out_dir!r} contains --workdir={workdir!r}; export into a directory of its own.")
  output.check_target(out_dir, overwrite, "--out", "config.json")  # before anything is read
  _check_reachable(out_dir)
  with ParamReader(workdir, step) as reader:
    written = _write(reader.config, reader.read, reader.shapes, out_dir, overwrite, kind, dtype, max_shard_size)
  out = out_dir if paths.is_remote(out_dir) else os.path.abspath(out_dir)
  return dict(step=reader.step, out=out, dtype=dtype, **written)


def _check_reachable(out_dir: str) -> None:
  """A gs:// target that cannot be written (no such bucket, no permission, no network): one sentence, before the
  checkpoint is read."""
  if paths.is_remote(out_dir):
    try:
      paths.check_writable(out_dir, ".sparsetx-export-probe")
    except paths.storage_errors() as error:
      raise ConfigError(
        f"--out={out_dir!r} cannot be written ({paths.cause(error)}); check the bucket's name and this account's "
        "write permission there."
      ) from None


def read_tensors(hf_dir: str) -> dict[str, np.ndarray]:
  """Every tensor of the safetensors weights in `hf_dir` (one file or an index of shards), float32, in memory."""
  with weight_files.WeightFiles(hf_dir) as weights:
    return {name: np.asarray(weights[name], np.float32) for name in weights}


def _in_param_dtype(model: ml_collections.ConfigDict, params):
  """`params` (a tree or one part) as numpy in the model's param dtype (neox reads float32; a saved param_dtype may
  be bfloat16).

  Names and shapes are the mappings' to check: both refuse weights that do not fit config.json.
  """
  param_dtype = jax.numpy.dtype(model.param_dtype)
  return jax.tree.map(lambda leaf: np.asarray(leaf).astype(param_dtype, copy=False), params)


def load_hf(hf_dir: str) -> tuple[ml_collections.ConfigDict, dict]:
  """(full sparsetx config, flax params as numpy in the param dtype) of a local HF directory (GPT-NeoX or sparsetx
  custom), the whole model in memory; `import_hf` writes one part at a time instead.

  The config is `default_config()` with the model section from config.json, the vocabulary from the
  tokenizer files when they are sparsetx's (byte or SentencePiece), and seq_len fitted to the context.
  """
  if paths.is_remote(hf_dir):
    raise ConfigError(
      f"{hf_dir!r} is a URL, but this reads a local directory; copy it here first (e.g. gsutil -m cp -r), or import "
      "it with --import_from, which reads gs://."
    )
  with weight_files.WeightFiles(_checked_hf_dir(hf_dir)) as weights:
    config, parts = _hf_parts(weights)
    check_files(config_lib.validate(config))
    return config, traverse_util.unflatten_dict(dict(parts))


def _checked_hf_dir(hf_dir: str) -> str:
  """`hf_dir` (local or gs://), refused in one sentence when it holds no config.json."""
  directory = paths.resolve(hf_dir)
  try:
    found = directory.is_dir(), (directory / "config.json").is_file()
  except paths.storage_errors() as error:
    raise ConfigError(
      f"{hf_dir!r} cannot be read ({paths.cause(error)}); check the bucket's name and this account's read "
      "permission there."
    ) from None
  if not found[0]:
    raise ConfigError(
      f"{hf_dir!r} is not a directory; give a directory written by python -m sparsetx.tools.export or save_pretrained."
    )
  if not found[1]:
    raise ConfigError(f"{hf_dir!r} has no config.json; it is not a Hugging Face model directory.")
  return hf_dir


def _hf_parts(weights: weight_files.WeightFiles) -> tuple[ml_collections.ConfigDict, object]:
  """(full config, the params as (flax path, subtree) parts in the param dtype, each made when reached) of the HF
  directory `weights` reads; its config.json and tokenizer files are read from `weights.local_dir`."""
  config_path = os.path.join(weights.local_dir, "config.json")
  shown = os.path.join(weights.hf_dir, "config.json")
  try:
    with open(config_path) as f:
      config_json = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as error:
    raise ConfigError(f"{shown!r} is not valid JSON ({error}); export the model again.") from error
  if not isinstance(config_json, dict):
    raise ConfigError(f"{shown!r} holds no JSON object; export the model again.")
  if config_json.get("model_type") == neox.MODEL_TYPE:
    model = neox.model_config(config_json)
    parts = neox.param_parts(model, weights)
  elif config_json.get("model_type") == "sparsetx" or "auto_map" in config_json:
    custom = _custom_module()
    model = custom.model_config_of(config_json)
    parts = custom.param_parts(model, weights)
  else:
    raise ConfigError(
      f"{shown!r} describes model_type={config_json.get('model_type')!r}; sparsetx imports GPT-NeoX "
      "('gpt_neox') directories and its own custom exports (with auto_map)."
    )
  config = config_lib.default_config()
  config.model = model
  config.data.seq_len = min(config.data.seq_len, model.max_len)
  vocab = tokenizer_files.vocab_of(weights.local_dir)
  if vocab is not None:
    config.data.vocab = vocab
  return config, _in_dtype(model, parts)


def _in_dtype(model: ml_collections.ConfigDict, parts):
  for path, value in parts:
    # a selection bias stays float32 whatever param_dtype, as the model holds it (models/ffn/selection_bias.py)
    value = np.asarray(value, np.float32) if path[-1] == selection_bias.NAME else _in_param_dtype(model, value)
    yield path, value
    del value  # before the next part is made (a generator's frame would hold it)


# ---------------------------------------------------------------------------------------------- writing checkpoints


def import_hf(
  hf_dir: str,
  workdir: str,
  overwrite: bool = False,
  config: ml_collections.ConfigDict | None = None,
  max_shard_size: str | int = shards.MAX_SHARD_SIZE,
) -> dict:
  """Writes the model of `hf_dir` (local or gs://) as the step-0 checkpoint of a new local `workdir`, holding about
  `max_shard_size` bytes of parameters at a time (train/checkpoints/param_writer.py); returns a summary: the config saved
  (`config`), the parameters and their bytes, the largest group written and the seconds taken.

  `config` (optional) is the training config to continue with: its data, train, checkpoint and mesh
  sections are kept and its model section is replaced by the imported one (its compute dtype and
  remat are kept). The step-0 checkpoint holds the params and no data position (the stream starts at its
  beginning); `python -m sparsetx.train --workdir=WORKDIR` with a config of the same model starts there with a
  fresh optimizer state. A gs:// directory's tokenizer file is kept in WORKDIR/tokenizer/.
  """
  if paths.is_remote(workdir):  # the staged workdir's commit is a local rename
    raise ConfigError(
      f"--workdir={workdir!r} is a URL, but import writes a local directory (staged, then renamed into place); "
      "import to a local path, then copy it (e.g. gsutil -m cp -r)."
    )
  cap = shards.parse_size(max_shard_size)
  output.check_target(workdir, overwrite, "--workdir", "checkpoints")
  if not paths.is_remote(hf_dir) and (_inside(hf_dir, workdir) or _inside(workdir, hf_dir)):
    raise ConfigError(f"--workdir={workdir!r} and the HF directory {hf_dir!r} overlap; give a new workdir.")
  with weight_files.WeightFiles(_checked_hf_dir(hf_dir)) as weights:
    imported, parts = _hf_parts(weights)
    if config is None:
      config = imported
    else:
      config = config.copy_and_resolve_references()
      compute = {k: config.model[k] for k in ("dtype", "remat")}
      config.model = imported.model
      config.model.update(compute)
    with output.StagedDirectory(workdir) as staged:
      if config.data.vocab.path.startswith(weights.local_dir + os.sep):  # a downloaded tokenizer file: kept
        name = os.path.basename(config.data.vocab.path)
        os.makedirs(os.path.join(staged.path, "tokenizer"))
        shutil.copyfile(config.data.vocab.path, os.path.join(staged.path, "tokenizer", name))
        config.data.vocab.path = os.path.join(staged.path, "tokenizer", name)
        check_files(config_lib.validate(config))
        config.data.vocab.path = os.path.join(staged.target, "tokenizer", name)
      else:
        check_files(config_lib.validate(config))
      began = time.perf_counter()
      written = param_writer.write_start(staged.path, config, parts, cap)
  return dict(config=config, seconds=time.perf_counter() - began, **written)

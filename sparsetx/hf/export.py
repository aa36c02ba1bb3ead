"""Checkpoints <-> directories in the Hugging Face layout (safetensors + config.json + tokenizer files).

`export` writes a trained model so that `transformers` loads it: dense GPT-NeoX-block models as
plain `GPTNeoXForCausalLM` (`sparsetx.hf.neox`), every other architecture with its own
PyTorch modeling files bundled (`sparsetx.hf.custom`, `trust_remote_code=True`).
`load_hf` reads either kind back into a sparsetx config and param tree; `import_hf` writes that as a
step-0 checkpoint from which `python -m sparsetx.train` continues.

Both writers build their output in a hidden sibling directory and rename it into place at the end,
so a failure leaves no half-written directory, and an existing one is replaced only when asked.
"""

import importlib
import json
import os
import shutil
import tempfile

import jax
import ml_collections
import numpy as np
import safetensors.flax
import safetensors.numpy

from sparsetx import config as config_lib
from sparsetx import paths
from sparsetx.data import check_files
from sparsetx.hf import neox, tokenizer_files
from sparsetx.train import checkpointing
from sparsetx.train import state as state_lib

KINDS = ("auto", "neox", "custom")
DTYPES = ("float32", "bfloat16")
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
ConfigError = config_lib.ConfigError


# ---------------------------------------------------------------------------------------------- reading checkpoints


def load_checkpoint(workdir: str, step: int | None = None) -> tuple[ml_collections.ConfigDict, dict, int]:
  """(config, params as numpy, step) of the checkpoint at `step` (default: the latest), on one device."""
  config, params, step = checkpointing.load(workdir, step, full_state=True)
  return config, jax.tree.map(np.asarray, jax.device_get(params)), step


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


def _check_target(out_dir: str, overwrite: bool, what: str, marker: str) -> None:
  """Refuses a target that holds files unless `overwrite`, and then only one holding `marker`."""
  if paths.is_remote(out_dir):  # _StagedDirectory's commit is a local rename
    raise ConfigError(
      f"{what}={out_dir!r} is a URL, but this writes a local directory (staged, then renamed into "
      "place); write it to a local path, then copy it (e.g. gsutil -m cp -r)."
    )
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ConfigError(f"{what}={out_dir!r} is a file; give a directory path.")
  if not os.path.isdir(out_dir) or not os.listdir(out_dir):
    return
  if not overwrite:
    raise ConfigError(f"{what}={out_dir!r} already holds files; choose a new directory or pass --overwrite.")
  if not os.path.exists(os.path.join(out_dir, marker)):
    raise ConfigError(
      f"{what}={out_dir!r} holds files but no {marker}, so it is not an earlier output of this tool; "
      "--overwrite only replaces those. Choose a new directory."
    )


class _StagedDirectory:
  """A hidden sibling of `target` to write into; `commit()` puts it in place of `target` in one rename.

  As a context manager it commits when the block ends normally and discards what was written otherwise.
  """

  def __init__(self, target: str):
    self.target = os.path.abspath(target)
    parent = os.path.dirname(self.target)
    os.makedirs(parent, exist_ok=True)
    self.path = tempfile.mkdtemp(prefix=f".{os.path.basename(self.target)}.partial-", dir=parent)

  def commit(self) -> None:
    old = None
    if os.path.isdir(self.target):
      old = tempfile.mkdtemp(prefix=f".{os.path.basename(self.target)}.old-", dir=os.path.dirname(self.target))
      os.rename(self.target, os.path.join(old, "replaced"))
    try:
      os.rename(self.path, self.target)
    except OSError:
      if old:  # put the previous directory back
        os.rename(os.path.join(old, "replaced"), self.target)
        os.rmdir(old)
      raise
    if old:
      shutil.rmtree(old, ignore_errors=True)

  def discard(self) -> None:
    shutil.rmtree(self.path, ignore_errors=True)

  def __enter__(self) -> "_StagedDirectory":
    return self

  def __exit__(self, error_type, error, traceback) -> None:
    if error_type is not None:
      self.discard()
      return
    try:
      self.commit()
    except BaseException:
      self.discard()
      raise


def _inside(path: str, directory: str) -> bool:
  path, directory = os.path.realpath(path), os.path.realpath(directory)
  return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _save_weights(tensors: dict[str, np.ndarray], path: str, dtype: str) -> None:
  metadata = {"format": "pt"}  # transformers refuses safetensors files without a known format
  if dtype == "float32":
    safetensors.numpy.save_file({k: np.asarray(v, np.float32) for k, v in tensors.items()}, path, metadata=metadata)
  else:  # safetensors.numpy has no bfloat16; its flax writer does
    with jax.default_device(jax.devices("cpu")[0]):
      arrays = {k: jax.numpy.asarray(v, jax.numpy.bfloat16) for k, v in tensors.items()}
    safetensors.flax.save_file(arrays, path, metadata=metadata)


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
) -> str:
  """Writes `params` of `config`'s model as an HF directory at `out_dir`; returns the mapping used."""
  if dtype not in DTYPES:
    raise ConfigError(f"--dtype={dtype!r} is unknown; use one of {', '.join(DTYPES)}.")
  mapping = mapping_for(config.model, kind)
  _check_target(out_dir, overwrite, "--out", "config.json")
  config_json, tensors = mapping.to_hf(config.model, params)
  config_json = dict(config_json, dtype=dtype, torch_dtype=dtype)  # torch_dtype: the transformers 4.x name
  with (
    paths.writing(f"writing {out_dir}", f"nothing was left there; {paths.FREE_SPACE}"),
    _StagedDirectory(out_dir) as staged,
  ):
    _save_weights(tensors, os.path.join(staged.path, WEIGHTS), dtype)
    _write_json(os.path.join(staged.path, "config.json"), config_json)
    _write_json(
      os.path.join(staged.path, "generation_config.json"),
      dict(
        bos_token_id=config_json["bos_token_id"],
        eos_token_id=config_json["eos_token_id"],
        pad_token_id=config_json["pad_token_id"],
        max_length=config.model.max_len,
      ),
    )
    for path in getattr(mapping, "MODELING_FILES", ()):
      shutil.copyfile(path, os.path.join(staged.path, os.path.basename(path)))
    tokenizer_files.write(config.data, config.model.max_len, staged.path)
  return "hf_" + mapping.__name__.rsplit(".", 1)[-1]  # the export kind: hf_neox | hf_custom


def export(
  workdir: str,
  out_dir: str,
  step: int | None = None,
  overwrite: bool = False,
  kind: str = "auto",
  dtype: str = "float32",
) -> dict:
  """Exports the checkpoint at `step` (default: latest) of `workdir` to `out_dir`; returns a summary."""
  if kind not in KINDS:
    raise ConfigError(f"--kind={kind!r} is unknown; use one of {', '.join(KINDS)}.")
  if _inside(workdir, out_dir):
    raise ConfigError(f"--out={out_dir!r} contains --workdir={workdir!r}; export into a directory of its own.")
  _check_target(out_dir, overwrite, "--out", "config.json")  # before the (slow) restore
  config, params, step = load_checkpoint(workdir, step)
  used = write_hf(config, params, out_dir, overwrite=overwrite, kind=kind, dtype=dtype)
  return dict(step=step, kind=used, out=os.path.abspath(out_dir), dtype=dtype)


# ---------------------------------------------------------------------------------------------- reading directories


def read_tensors(hf_dir: str) -> dict[str, np.ndarray]:
  """Every tensor of the safetensors weights in `hf_dir` (one file or an index of shards), float32."""
  index = os.path.join(hf_dir, WEIGHTS_INDEX)
  if os.path.isfile(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.isfile(os.path.join(hf_dir, WEIGHTS)):
    files = [WEIGHTS]
  else:
    pickled = [
      n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json") if os.path.exists(os.path.join(hf_dir, n))
    ]
    hint = (
      f"it holds {pickled[0]} (pickle, which sparsetx never loads); re-save it with "
      "save_pretrained(dir, safe_serialization=True)"
      if pickled
      else "export the model again"
    )
    raise ConfigError(f"{hf_dir!r} has no {WEIGHTS} or {WEIGHTS_INDEX}; {hint}.")
  tensors = {}
  with jax.default_device(jax.devices("cpu")[0]):  # the flax reader knows bfloat16; keep it off accelerators
    for name in files:
      path = os.path.join(hf_dir, name)
      if not os.path.isfile(path):
        raise ConfigError(
          f"{WEIGHTS_INDEX} in {hf_dir!r} names {name!r}, which is missing; the directory is incomplete."
        )
      try:
        loaded = safetensors.flax.load_file(path)
      except Exception as error:  # safetensors raises its own error types for a corrupt header
        raise ConfigError(f"{path!r} is not a readable safetensors file ({error}); export the model again.") from error
      tensors.update({k: np.asarray(v, np.float32) for k, v in loaded.items()})
  return tensors


def _in_param_dtype(model: ml_collections.ConfigDict, params) -> dict:
  """`params` as numpy in the model's param dtype (neox reads float32; a saved param_dtype may be bfloat16).

  Names and shapes are the mappings' to check: both refuse weights that do not fit config.json.
  """
  param_dtype = jax.numpy.dtype(model.param_dtype)
  return jax.tree.map(lambda leaf: np.asarray(leaf).astype(param_dtype, copy=False), params)


def load_hf(hf_dir: str) -> tuple[ml_collections.ConfigDict, dict]:
  """(full sparsetx config, flax params as numpy in the param dtype) of an HF directory (GPT-NeoX or sparsetx custom).

  The config is `default_config()` with the model section from config.json, the vocabulary from the
  tokenizer files when they are sparsetx's (byte or SentencePiece), and seq_len fitted to the context.
  """
  if not os.path.isdir(hf_dir):
    raise ConfigError(
      f"{hf_dir!r} is not a directory; give a directory written by python -m sparsetx.tools.export or save_pretrained."
    )
  config_path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(config_path):
    raise ConfigError(f"{hf_dir!r} has no config.json; it is not a Hugging Face model directory.")
  try:
    with open(config_path) as f:
      config_json = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as error:
    raise ConfigError(f"{config_path!r} is not valid JSON ({error}); export the model again.") from error
  if not isinstance(config_json, dict):
    raise ConfigError(f"{config_path!r} holds no JSON object; export the model again.")
  if config_json.get("model_type") == neox.MODEL_TYPE:
    mapping = neox
  elif config_json.get("model_type") == "sparsetx" or "auto_map" in config_json:
    mapping = _custom_module()
  else:
    raise ConfigError(
      f"{config_path!r} describes model_type={config_json.get('model_type')!r}; sparsetx imports GPT-NeoX "
      "('gpt_neox') directories and its own custom exports (with auto_map)."
    )
  model, params = mapping.from_hf(config_json, read_tensors(hf_dir))
  config = config_lib.default_config()
  config.model = model
  config.data.seq_len = min(config.data.seq_len, model.max_len)
  vocab = tokenizer_files.vocab_of(hf_dir)
  if vocab is not None:
    config.data.vocab = vocab
  check_files(config_lib.validate(config))
  return config, _in_param_dtype(config.model, params)


# ---------------------------------------------------------------------------------------------- writing checkpoints


def import_hf(
  hf_dir: str, workdir: str, overwrite: bool = False, config: ml_collections.ConfigDict | None = None
) -> ml_collections.ConfigDict:
  """Writes the model of `hf_dir` as the step-0 checkpoint of a new `workdir`; returns the config saved.

  `config` (optional) is the training config to continue with: its data, train, checkpoint and mesh
  sections are kept and its model section is replaced by the imported one (its compute dtype and
  remat are kept). The step-0 checkpoint holds the params, a fresh optimizer state and no data
  position (the stream starts at its beginning), so `python -m sparsetx.train --workdir=WORKDIR` with a config of the same model
  resumes there like any other run.
  """
  from sparsetx.parallel import mesh as mesh_lib

  _check_target(workdir, overwrite, "--workdir", "checkpoints")
  if _inside(hf_dir, workdir) or _inside(workdir, hf_dir):
    raise ConfigError(f"--workdir={workdir!r} and the HF directory {hf_dir!r} overlap; give a new workdir.")
  imported, params = load_hf(hf_dir)
  if config is None:
    config = imported
  else:
    config = config.copy_and_resolve_references()
    compute = {k: config.model[k] for k in ("dtype", "remat")}
    config.model = imported.model
    config.model.update(compute)
    check_files(config_lib.validate(config))
  mesh = mesh_lib.make_mesh(config.mesh)
  _, shardings, model, tx = state_lib.state_shardings(config, mesh)
  with _StagedDirectory(workdir) as staged:
    state = jax.jit(lambda p: state_lib.new_state(model, p, tx, config.train), out_shardings=shardings)(
      jax.device_put(params, shardings.params)
    )
    checkpointer = checkpointing.Checkpointer(staged.path, config.checkpoint)
    try:
      checkpointer.save(0, state, config, data_state=None)  # the stream starts at its beginning
      checkpointer.wait()
    finally:
      checkpointer.close()
  return config

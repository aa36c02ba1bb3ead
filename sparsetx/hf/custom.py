"""Export kind `custom`: any sparsetx model as a Hugging Face directory with its own PyTorch modeling file.

The directory holds `configuration_sparsetx.py` and `modeling_sparsetx.py` (MODELING_FILES, under
modeling/), named in config.json's `auto_map`, so `AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)` runs the model in PyTorch. The modeling file reimplements the JAX forward in
float32 for every architecture sparsetx builds (sgatlin, FFF, PEER, MoE, SwiGLU, MLP; both block kinds).

More: docs/modules.md, sparsetx/hf/custom.py.
"""

import pathlib
import re
from collections.abc import Iterator

import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import traverse_util

from sparsetx import config as config_lib
from sparsetx.config import ConfigError
from sparsetx.hf import lazy_tensors
from sparsetx.hf.neox import EOS_ID, PAD_ID, SPARSETX_KEY
from sparsetx.hf.neox import START_ID as BOS_ID
from sparsetx.models.ffn import selection_bias
from sparsetx.train.checkpoints import checkpointing

MODEL_TYPE = "sparsetx"
_MODELING_DIR = pathlib.Path(__file__).resolve().parent / "modeling"
MODELING_FILES = [str(_MODELING_DIR / "configuration_sparsetx.py"), str(_MODELING_DIR / "modeling_sparsetx.py")]
AUTO_MAP = {
  "AutoConfig": "configuration_sparsetx.SparsetxConfig",
  "AutoModelForCausalLM": "modeling_sparsetx.SparsetxForCausalLM",
}


def unsupported_reason(model_config) -> str | None:
  """None when modeling_sparsetx.py implements this architecture (every one sparsetx can build)."""
  try:
    config_lib.validate_model(model_config)
  except ConfigError as error:
    return f"the model config is invalid: {error}"
  return None


def tensor_name(path: tuple) -> str:
  """Flax path ('layers_0', 'attention', 'query', 'kernel') -> 'model.layers.0.attention.query.kernel'."""
  parts = [re.sub(r"^layers_(\d+)$", r"layers.\1", part) for part in path]
  name = ".".join(parts)
  return name if path[0] == "lm_head" else f"model.{name}"


def flax_path(name: str) -> tuple:
  """The inverse of tensor_name."""
  name = name.removeprefix("model.")
  name = re.sub(r"^layers\.(\d+)\.", r"layers_\1.", name)
  return tuple(name.split("."))


def expected_shapes(model_config) -> dict:
  """Tensor name -> shape of every parameter the model config builds (traced abstractly, nothing computed)."""
  return {tensor_name(path): shape for path, shape in lazy_tensors.param_shapes(model_config).items()}


def to_hf(model_config, params) -> tuple[dict, dict]:
  """(config.json dict, {tensor name: float32 numpy array}) for a model config and its flax params, in memory."""
  shapes = {tensor_name(path): shape for path, shape in lazy_tensors.tree_shapes(params).items()}
  config_json, tensors = hf_tensors(model_config)
  _check_shapes(model_config, shapes, "the parameters")
  arrays = lazy_tensors.tree_reader(params)(list(lazy_tensors.tree_shapes(params)))
  return config_json, {name: lazy_tensors.made(tensor, arrays) for name, tensor in tensors.items()}


def hf_tensors(model_config) -> tuple[dict, dict[str, lazy_tensors.HfTensor]]:
  """(config.json dict, {tensor name: the parameter it is}) for a model config: one tensor per parameter."""
  reason = unsupported_reason(model_config)
  if reason is not None:
    raise ConfigError(f"cannot export as kind 'custom': {reason}")
  m = model_config
  config_json = dict(
    model_type=MODEL_TYPE,
    architectures=["SparsetxForCausalLM"],
    auto_map=dict(AUTO_MAP),
    **{SPARSETX_KEY: ml_collections.ConfigDict(m).to_dict()},
    vocab_size=m.vocab_size,
    hidden_size=m.d_model,
    num_hidden_layers=m.n_layers,
    num_attention_heads=m.d_model // m.head_dim,
    head_dim=m.head_dim,
    max_position_embeddings=m.max_len,
    tie_word_embeddings=bool(m.tie_embeddings),
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    dtype="float32",
  )
  return config_json, {tensor_name(path): lazy_tensors.HfTensor((path,)) for path in lazy_tensors.param_shapes(m)}


def from_hf(config_json: dict, tensors) -> tuple[ml_collections.ConfigDict, dict]:
  """(model config, flax param tree of numpy arrays in config.param_dtype) from an exported directory's contents."""
  model_config = model_config_of(config_json)
  return model_config, traverse_util.unflatten_dict(dict(param_parts(model_config, tensors)))


def model_config_of(config_json: dict) -> ml_collections.ConfigDict:
  """The sparsetx model config an export keeps in its config.json."""
  if config_json.get("model_type") != MODEL_TYPE or not isinstance(config_json.get(SPARSETX_KEY), dict):
    raise ConfigError(
      f"config.json has model_type={config_json.get('model_type')!r} without a {SPARSETX_KEY!r} model config; "
      "import a directory written by sparsetx's export (kind 'custom')."
    )
  # As a checkpoint's saved config: tuples restored, fields newer than the export at their defaults.
  model_config = checkpointing.config_from_saved({"model": config_json[SPARSETX_KEY]}).model
  try:
    config_lib.validate_model(model_config)
  except ConfigError as error:
    raise ConfigError(f"config.json's {SPARSETX_KEY!r} model config is invalid: {error}") from None
  return model_config


def param_parts(model_config, tensors) -> Iterator[tuple[tuple, np.ndarray]]:
  """(flax path, array in config.param_dtype) of each parameter, each read from `tensors` (a dict, or a lazy
  mapping that reads it now) when reached. Names are checked before anything is read, shapes as each is."""
  expected = expected_shapes(model_config)
  _check_names(expected, tensors, "the weights")
  param_dtype = jnp.dtype(model_config.param_dtype)
  for name, shape in expected.items():
    array = np.asarray(tensors[name])
    _check_shape(name, array.shape, shape, "the weights")
    path = flax_path(name)
    yield path, array.astype(jnp.float32 if path[-1] == selection_bias.NAME else param_dtype, copy=False)
    del array  # before the next read: a consumer that let go of it holds one tensor, not two


def _check_shapes(model_config, tensors: dict, source: str) -> None:
  """One clear error when the tensors ({name: shape}) do not match what the model config builds."""
  expected = expected_shapes(model_config)
  _check_names(expected, tensors, source)
  for name, shape in expected.items():
    _check_shape(name, tuple(tensors[name]), shape, source)


def _check_names(expected: dict, names, source: str) -> None:
  missing = sorted(set(expected) - set(names))
  unexpected = sorted(set(names) - set(expected))
  if missing or unexpected:
    raise ConfigError(
      f"the tensors of {source} do not match the model config: missing {missing[:3]}, unexpected {unexpected[:3]}"
      f"{' (and more)' if len(missing) > 3 or len(unexpected) > 3 else ''}; export and import the same model."
    )


def _check_shape(name: str, shape: tuple, expected: tuple, source: str) -> None:
  if tuple(shape) != tuple(expected):
    raise ConfigError(
      f"{source}: tensor {name!r} has shape {tuple(shape)} but the model config builds {tuple(expected)}; "
      "export and import the same model."
    )

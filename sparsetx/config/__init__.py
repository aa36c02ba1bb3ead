"""sparsetx's run config: `from sparsetx import config as config_lib`, then `config_lib.default_config()`,
`config_lib.validate(config)`, `config_lib.ConfigError`.

Split by concern so each part can be read and imported alone, and so this package imports nothing else
from sparsetx (every other layer may import it):
  errors.py      `ConfigError` and the helpers that raise it
  schema.py      every field with its default; per-layer and per-run helpers (`layer_ffn_config`, ...)
  checks.py      `validate(config)`: cross-field checks, no file I/O
  ffn_checks.py  the checks of one feed-forward sub-config (`validate_ffn`) and its choices
Whether the data and tokenizer files exist is checked where they are opened: `sparsetx.data.check_files`.
"""

import ml_collections  # noqa: F401  (callers write config_lib.ml_collections.ConfigDict)

from sparsetx.config.checks import (
  validate,
  validate_attention,
  validate_data,
  validate_finite,
  validate_mesh,
  validate_model,
  validate_source,
  validate_train,
)
from sparsetx.config.errors import ConfigError, one_of, positive_int, require
from sparsetx.config.ffn_checks import (
  FFF_IMPLEMENTATIONS,
  FFF_VARIANTS,
  FFN_CHECKS,
  FFN_TYPES,
  GPU_KERNELS,
  KERNEL_IMPLEMENTATIONS,
  SGATLIN_ACTIVATIONS,
  SGATLIN_ROUTERS,
  n_keys_for,
  validate_ffn,
)
from sparsetx.config.schema import (
  ATTENTION_IMPLEMENTATIONS,
  BLOCK_KINDS,
  BYTE_VOCAB_SIZE,
  DATA_EMBEDDED_TASKS,
  DATA_SOURCE_KINDS,
  DATA_VOCAB_KINDS,
  DEFAULT_RULES,
  DTYPES,
  MESH_AXES,
  NORM_KINDS,
  REMAT_POLICIES,
  SCHEDULES,
  checkpoint_defaults,
  data_defaults,
  default_config,
  dense_ffn_defaults,
  ffn_defaults,
  ffn_layer_indices,
  is_mixed,
  layer_ffn_config,
  listed_ffn_layers,
  mesh_defaults,
  model_defaults,
  profile_steps,
  remat_policy,
  source_patterns,
  train_defaults,
)

__all__ = [
  "ATTENTION_IMPLEMENTATIONS",
  "BLOCK_KINDS",
  "BYTE_VOCAB_SIZE",
  "ConfigError",
  "DATA_EMBEDDED_TASKS",
  "DATA_SOURCE_KINDS",
  "DATA_VOCAB_KINDS",
  "DEFAULT_RULES",
  "DTYPES",
  "FFF_IMPLEMENTATIONS",
  "FFF_VARIANTS",
  "FFN_CHECKS",
  "FFN_TYPES",
  "GPU_KERNELS",
  "KERNEL_IMPLEMENTATIONS",
  "MESH_AXES",
  "NORM_KINDS",
  "REMAT_POLICIES",
  "SCHEDULES",
  "SGATLIN_ACTIVATIONS",
  "SGATLIN_ROUTERS",
  "checkpoint_defaults",
  "data_defaults",
  "default_config",
  "dense_ffn_defaults",
  "ffn_defaults",
  "ffn_layer_indices",
  "is_mixed",
  "layer_ffn_config",
  "listed_ffn_layers",
  "mesh_defaults",
  "model_defaults",
  "n_keys_for",
  "one_of",
  "positive_int",
  "profile_steps",
  "remat_policy",
  "require",
  "source_patterns",
  "train_defaults",
  "validate",
  "validate_attention",
  "validate_data",
  "validate_ffn",
  "validate_finite",
  "validate_mesh",
  "validate_model",
  "validate_source",
  "validate_train",
]

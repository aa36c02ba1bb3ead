"""The config a checkpoint was trained with, read under today's schema, and the model fields that fix its parameters
(what a resume must match; compute-only fields may change).

More: docs/modules.md.
"""

import ml_collections

from sparsetx import config as config_lib

COMPUTE_ONLY = (
  "dtype",
  "remat",
  "attention",
  "max_len",
  "kernel",
  "implementation",
  "aux_loss",
  "router_z_loss",
  "logits_dot_in_fp32",
  "scan_layers",
)  # may change on resume (MoE balancing weights: the loss, not the parameters)


def _tuples(value):
  """JSON turns the config's tuples (mixture, sharding rules) into lists; the schema wants tuples."""
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(_tuples(v) for v in value)
  return value


def _merged(defaults: dict, saved: dict) -> dict:
  return {
    **defaults,
    **{
      k: _merged(defaults[k], v) if isinstance(defaults.get(k), dict) and isinstance(v, dict) else v
      for k, v in saved.items()
    },
  }


def config_from_saved(saved: dict) -> ml_collections.ConfigDict:
  """The config a checkpoint was trained with: today's defaults overridden by every saved field, so a
  checkpoint written before a field existed reads with that field's default, and one written with the retired
  kernel knobs (implementation=pallas, gpu_kernel) reads under the one knob that replaced them (attention=pallas,
  retired too, as auto)."""
  saved = _tuples(saved)
  if saved.get("model", {}).get("attention") == "pallas":  # retired: auto takes cuDNN's fused kernel on a GPU
    saved = saved | {"model": saved["model"] | {"attention": "auto"}}
  kernel = saved.get("model", {}).get("ffn", {}).get("kernel")
  if isinstance(kernel, dict) and ("gpu_kernel" in kernel or kernel.get("implementation") == "pallas"):
    implementation = config_lib.implementation_for_retired(
      kernel.get("implementation", "auto"), kernel.get("gpu_kernel")
    )
    kernel = {k: v for k, v in kernel.items() if k != "gpu_kernel"} | {"implementation": implementation}
    saved = saved | {"model": saved["model"] | {"ffn": saved["model"]["ffn"] | {"kernel": kernel}}}
  return ml_collections.ConfigDict(_merged(config_lib.default_config().to_dict(), saved))


def model_fields(model: dict, prefix: str = "") -> dict:
  """The model's fields that fix its parameters, flattened to dotted names in schema order (compute-only
  fields left out)."""
  fields = {}
  for key, value in model.items():
    if key in COMPUTE_ONLY:
      continue
    if isinstance(value, dict):
      fields.update(model_fields(value, f"{prefix}{key}."))
    else:
      fields[f"{prefix}{key}"] = value
  return fields


def basic_rank(key: str) -> int:
  """Most basic first: the layer types, then the network's own fields, then each feed-forward layer's sizes."""
  if key.endswith("type") and "." in key:
    return 0
  return 1 if "." not in key else 2


def first_index(key: str, *orders: dict) -> int:
  for order in orders:
    if key in order:
      return list(order).index(key)
  return 0

"""Sparse fine-tuning from a dense model (the FFF paper's "FT" regime): swap feed-forward layers.

The target model is the source's architecture with another feed-forward layer (`config.model.ffn`) in
every block, or only in the blocks `config.model.ffn_layers` lists (the others keep the source's,
as `config.model.dense_ffn`). Every parameter outside the swapped feed-forward layers is copied
bit for bit; the swapped layers are initialized fresh, exactly as the layer initializes itself in a
new model of the target config (seed config.train.seed). The result is written as a step-0
checkpoint, which `python -m sparsetx.train` starts from with fresh optimizer state and data stream.

More: docs/modules.md, sparsetx/sparsify.py.
"""

import json

import jax
import ml_collections
import numpy as np

from sparsetx import config as config_lib
from sparsetx import paths
from sparsetx.config import ConfigError
from sparsetx.data import check_files
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import optimizer
from sparsetx.train import state as state_lib
from sparsetx.train.checkpoints import checkpointing

# Model fields the target may set freely: the feed-forward choice and compute-only knobs. Every other
# field (d_model, head_dim, vocab_size, n_layers, block, norm, biases, rotary, param_dtype, ...) shapes or
# defines the copied parameters and must equal the source's.
FREE_FIELDS = ("ffn", "ffn_layers", "dense_ffn", "dtype", "remat", "attention", "max_len", "init_std")
REPORT_FILE = "sparsify.json"
TRAINER_OUTPUTS = ("checkpoints", "tokenized", "tensorboard", "metrics.jsonl", REPORT_FILE)


def load_checkpoint(workdir: str, mesh, step: int | None = None):
  """(config, params) of a sparsetx workdir's checkpoint at `step` (default: the latest)."""
  config, params, _ = checkpointing.load(workdir, step, mesh, workdir_flag="--source", step_flag="--source_step")
  return config, params


def check_same_architecture(source: ml_collections.ConfigDict, target: ml_collections.ConfigDict) -> None:
  """Refuses a target whose model differs from the source's outside the feed-forward choice, naming the field."""
  for key in sorted(set(source.keys()) | set(target.keys())):
    if key in FREE_FIELDS:
      continue
    if source.get(key) != target.get(key):
      raise ConfigError(
        f"config.model.{key}={target.get(key)!r} but the source model has {source.get(key)!r}; sparsify keeps "
        f"everything outside the feed-forward layers, so set config.model.{key}={source.get(key)!r}."
      )


def kept_ffn_config(source: ml_collections.ConfigDict, target: ml_collections.ConfigDict):
  """The source's feed-forward sub-config of the layers the target keeps (its dense_ffn); None if it keeps none."""
  swapped = set(config_lib.ffn_layer_indices(target))
  kept = [config_lib.layer_ffn_config(source, i).to_dict() for i in range(target.n_layers) if i not in swapped]
  if not kept:
    return None
  if any(ffn != kept[0] for ffn in kept):
    raise ConfigError(
      "the source model mixes feed-forward types over the layers config.model.ffn_layers keeps; swap those "
      "layers too, or keep only layers that share one type."
    )
  return ml_collections.ConfigDict(kept[0])


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", k)) for k in path)


def _group(name: str) -> str:
  """'layers_0/attention/query/kernel' -> 'layers_0/attention'; 'embed/embedding' -> 'embed'."""
  parts = name.split("/")
  return "/".join(parts[:2]) if parts[0].startswith("layers_") else parts[0]


def _summary(names_sizes: dict) -> dict:
  groups = {}
  for name, size in names_sizes.items():
    groups[_group(name)] = groups.get(_group(name), 0) + size
  return dict(parameters=sum(names_sizes.values()), tensors=len(names_sizes), groups=groups, names=sorted(names_sizes))


def sparsify(source_config, source_params, config: ml_collections.ConfigDict, mesh):
  """(target config, step-0 train state, report) from a source model and the target `config`.

  The target config's dense_ffn is set to the source's feed-forward layer when some layers are kept.
  """
  config = config.copy_and_resolve_references()
  source_model = source_config.model
  check_same_architecture(source_model, config.model)
  kept = kept_ffn_config(source_model, config.model)
  if kept is not None:
    config.model.dense_ffn = kept
  check_files(config_lib.validate(config))

  _, shardings, model, tx = state_lib.state_shardings(config, mesh)
  fresh = state_lib.create_state(config, shardings, model, tx)
  labels = optimizer.freeze_labels(fresh.params, config.model)  # the same "new" layers freeze_steps trains
  source_leaves = {_path_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(source_params)}
  copied, new = {}, {}

  def take(path, fresh_leaf, sharding, label):
    name = _path_name(path)
    size = int(np.prod(fresh_leaf.shape))
    if label == "new":
      new[name] = size
      return fresh_leaf
    if name not in source_leaves:
      raise ConfigError(
        f"the target model has parameter {name!r}, which the source model lacks; "
        "the two architectures differ outside the feed-forward layers."
      )
    leaf = source_leaves[name]
    if tuple(leaf.shape) != tuple(fresh_leaf.shape) or leaf.dtype != fresh_leaf.dtype:
      raise ConfigError(
        f"parameter {name!r} is {leaf.dtype}{list(leaf.shape)} in the source but "
        f"{fresh_leaf.dtype}{list(fresh_leaf.shape)} in the target; the architectures must match "
        "outside the feed-forward layers."
      )
    copied[name] = size
    return jax.device_put(leaf, sharding)

  params = jax.tree_util.tree_map_with_path(take, fresh.params, shardings.params, labels)
  dropped = {name: int(np.prod(leaf.shape)) for name, leaf in source_leaves.items() if name not in copied}
  report = dict(
    swapped_layers=list(config_lib.ffn_layer_indices(config.model)),
    ffn=config.model.ffn.to_dict(),
    copied=_summary(copied),
    new=_summary(new),
    dropped=_summary(dropped),
    total=sum(copied.values()) + sum(new.values()),
  )
  return config, fresh.replace(params=params), report


def check_target_workdir(workdir: str, overwrite: bool) -> list[str]:
  """The trainer's outputs already in `workdir`; refuses them unless `overwrite`."""
  existing = [name for name in TRAINER_OUTPUTS if (paths.resolve(workdir) / name).exists()]  # local or gs://
  if existing and not overwrite:
    raise ConfigError(
      f"--workdir={workdir!r} already holds {', '.join(existing)}; choose a new directory or pass --overwrite "
      "to replace that run."
    )
  return existing


def remove_outputs(workdir: str, names: list[str]) -> None:
  """Removes the previous run's outputs (--overwrite), only once the new start is ready to be written."""
  for name in names:
    path = paths.resolve(workdir) / name
    path.rmtree() if path.is_dir() else path.unlink()


def write_start(workdir: str, config: ml_collections.ConfigDict, state, report: dict) -> None:
  """The step-0 checkpoint (parameters, fresh optimizer state, config) and the report as JSON."""
  paths.resolve(workdir).mkdir(parents=True, exist_ok=True)
  checkpointer = checkpointing.Checkpointer(workdir, config.checkpoint)
  try:
    checkpointer.save(0, state, config, data_state=None)  # the trainer starts the stream at its beginning
    checkpointer.wait()
  finally:
    checkpointer.close()
  if jax.process_index() == 0:
    (paths.resolve(workdir) / REPORT_FILE).write_text(json.dumps(report, indent=1))


def _by_module(groups: dict) -> str:
  """'layers_0/attention 65,536, layers_1/attention 65,536' -> 'attention x2 131,072' (per-layer detail: the JSON)."""
  totals, layers = {}, {}
  for group, n in groups.items():
    module = group.split("/", 1)[1] if group.startswith("layers_") else group
    totals[module] = totals.get(module, 0) + n
    layers[module] = layers.get(module, 0) + group.startswith("layers_")
  return ", ".join(f"{m}{f' x{layers[m]}' if layers[m] else ''} {n:,}" for m, n in sorted(totals.items())) or "-"


def format_report(report: dict) -> str:
  """A table: parameters copied / new / dropped, by module (summed over layers)."""
  lines = [f"{'':<10}{'parameters':>14}{'tensors':>9}  by module"]
  for kind in ("copied", "new", "dropped"):
    part = report[kind]
    lines.append(f"{kind:<10}{part['parameters']:>14,}{part['tensors']:>9}  {_by_module(part['groups'])}")
  lines.append(f"{'total':<10}{report['total']:>14,}  (copied + new: the new model's parameters)")
  return "\n".join(lines)


def sparsify_checkpoint(
  source_workdir: str,
  config: ml_collections.ConfigDict,
  workdir: str,
  overwrite: bool = False,
  source_step: int | None = None,
):
  """sparsetx/tools/sparsify.py on a sparsetx source: (target config, report); writes the start into `workdir`."""
  if paths.resolve(source_workdir) == paths.resolve(workdir):
    raise ConfigError(f"--workdir={workdir!r} is the source itself; write the sparsified model to a new directory.")
  check_files(config_lib.validate(config))
  check_target_workdir(workdir, overwrite)  # before the (slow) source is read
  mesh = mesh_lib.make_mesh(config.mesh)
  source_config, source_params = load_checkpoint(source_workdir, mesh, source_step)
  return sparsify_params(source_config, source_params, config, workdir, mesh, overwrite)


def sparsify_hf(hf_dir: str, config: ml_collections.ConfigDict, workdir: str, overwrite: bool = False):
  """sparsetx/tools/sparsify.py --from_hf: the source is a Hugging Face directory (GPT-NeoX or a sparsetx export)."""
  from sparsetx.hf import export  # the HF stack (safetensors, tokenizers) only when asked for

  check_files(config_lib.validate(config))
  check_target_workdir(workdir, overwrite)
  source_config, source_params = export.load_hf(hf_dir)
  return sparsify_params(source_config, source_params, config, workdir, mesh_lib.make_mesh(config.mesh), overwrite)


def sparsify_params(source_config, source_params, config, workdir: str, mesh, overwrite: bool = False):
  """Any (config, params) source, e.g. an imported HF model: (target config, report); writes the start."""
  existing = check_target_workdir(workdir, overwrite)
  config, state, report = sparsify(source_config, source_params, config, mesh)
  remove_outputs(workdir, existing)
  write_start(workdir, config, state, report)
  return config, report

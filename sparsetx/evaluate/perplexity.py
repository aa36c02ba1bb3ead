"""Loss and perplexity of a checkpoint on validation splits, restored onto any mesh.

The numbers are the trainer's own (`sparsetx.train.loop.evaluate` with the same jitted
`eval_step`, the same packed validation batches and `eval_batches` limit), so a checkpoint's final
eval in `metrics.jsonl` is reproduced exactly, on one device or any other mesh: orbax reshards the
saved arrays onto the shardings the mesh gives the parameters. Loss is nats per target token
(EOS included, padding excluded); perplexity is exp(loss).
"""

import functools

import jax
import ml_collections

from sparsetx import config as config_lib
from sparsetx.data import check_files, pipeline, sources
from sparsetx.models.ffn import placement
from sparsetx.parallel import expert_parallel
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import checkpointing, loop
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib


def mesh_config(config: ml_collections.ConfigDict, spec: str) -> ml_collections.ConfigDict:
  """`config.mesh` for `spec`: 'one' (a single device), 'saved' (as trained), or 'data=2,fsdp=4,...' (ici sizes)."""
  mesh = config.mesh.copy_and_resolve_references()
  if spec == "saved":
    return mesh
  sizes = dict(data=1, fsdp=1, tensor=1, expert=1)
  if spec != "one":
    for item in spec.split(","):
      axis, _, size = item.partition("=")
      if axis.strip() not in sizes or not size.strip().lstrip("-").isdigit():
        raise config_lib.ConfigError(
          f"--mesh={spec!r} is not 'one', 'saved' or a list like 'data=2,fsdp=2' over axes {', '.join(sizes)}."
        )
      sizes[axis.strip()] = int(size)
  mesh.ici.update(sizes)
  if spec == "one":
    mesh.dcn.update(data=1, fsdp=1, tensor=1, expert=1)
  return mesh


def restore(workdir: str, step: int | None = None, mesh: str = "one", tasks: list[str] | None = None):
  """(config, mesh, model, params, step) of the checkpoint at `step` (default the latest) on `mesh`.

  `tasks` replaces the saved mixture (each task once); the saved config is used as trained
  (its dtype included), so the numbers are those the trainer reports. `export.load_checkpoint`
  reads through this too (mesh 'one').
  """
  manager = checkpointing.open_read_only(workdir)
  try:
    step = manager.checked_step(step)
    config = manager.saved_config(step)
    if tasks:
      config.data.mixture = tuple((name, 1.0) for name in tasks)
      for name in tasks:  # an unknown task is named now, before anything is compiled
        sources.make_source(name, (config.data.sources or {}).get(name))
    config.mesh = mesh_config(config, mesh)
    check_files(config_lib.validate(config))
    device_mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1] if mesh == "one" else None)
    loop.check_batch_divides(config, device_mesh)
    placement.check_units_divide(config, device_mesh)
    abstract, _, model, _ = state_lib.state_shardings(config, device_mesh)
    try:
      params = manager.restore_state(step, abstract).params
    except config_lib.ConfigError:  # a damaged step (checkpointing.CheckpointError): reported as it is
      raise
    except (ValueError, KeyError, TypeError) as error:
      raise config_lib.ConfigError(
        f"the checkpoint at step {step} in {manager.directory} does not match the model of its own config ({error}); "
        "it was written by another version of the model code."
      ) from error
  finally:
    manager.close()
  return config, device_mesh, model, params, step


def evaluate(config: ml_collections.ConfigDict, device_mesh, model, params, eval_batches: int | None = None) -> dict:
  """{'eval/<task>/loss': nats per token, 'eval/<task>/perplexity': ...} over each task's validation split.

  `eval_batches` (default: the checkpoint's config.train.eval_batches) limits the batches per task; 0 = all.
  """
  config = config.copy_and_resolve_references()
  if eval_batches is not None:
    config.train.eval_batches = eval_batches
  batch_sharding = mesh_lib.batch_sharding(device_mesh, config.mesh.rules)
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  eval_fn = jax.jit(functools.partial(step_lib.eval_step, model=model), in_shardings=(param_shardings, batch_sharding))
  eval_data = pipeline.EvalData(config, batch_sharding, split="validation")
  with expert_parallel.activate(device_mesh, config.mesh.rules):  # as the trainer traces its eval
    return loop.evaluate(config, params, eval_fn, eval_data)

"""Loss and perplexity of a checkpoint on validation splits, restored onto any mesh.

The numbers are the trainer's own (`sparsetx.train.run.operations.evaluation.evaluate` with the same jitted
`eval_step`, the same packed validation batches and `eval_batches` limit), so a checkpoint's final
eval in `metrics.jsonl` is reproduced exactly, on one device or any other mesh: orbax reshards the
saved arrays onto the shardings the mesh gives the parameters. Loss is nats per target token
(EOS included, padding excluded); perplexity is exp(loss).
"""

import jax
import ml_collections

from sparsetx import config as config_lib
from sparsetx.data import global_stream, pretokenize, sources
from sparsetx.parallel import logical_rules
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib
from sparsetx.train.checkpoints import checkpointing
from sparsetx.train.run.operations import evaluation


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
  (its dtype included), so the numbers are those the trainer reports.
  """

  def adjust(config):
    if tasks:
      config.data.mixture = tuple((name, 1.0) for name in tasks)
      for name in tasks:  # an unknown task is named now, before anything is compiled
        sources.make_source(name, (config.data.sources or {}).get(name))
    config.mesh = mesh_config(config, mesh)

  def device_mesh(config):
    return state_lib.checked_mesh(config, jax.devices()[:1] if mesh == "one" else None)

  config, params, step = checkpointing.load(workdir, step, device_mesh, adjust=adjust)  # parameters only
  config = pretokenize.train_corpus(config, workdir)  # the run's corpus (a run saved without one: written now)
  return config, jax.tree.leaves(params)[0].sharding.mesh, state_lib.build_model(config), params, step


def evaluate(config: ml_collections.ConfigDict, device_mesh, model, params, eval_batches: int | None = None) -> dict:
  """{'eval/<task>/loss': nats per token, 'eval/<task>/perplexity': ...} over each task's validation split.

  `eval_batches` (default: the checkpoint's config.train.eval_batches) limits the batches per task; 0 = all.
  """
  config = config.copy_and_resolve_references()
  if eval_batches is not None:
    config.train.eval_batches = eval_batches
  batch_sharding = mesh_lib.batch_sharding(device_mesh, config.mesh.rules)
  eval_fn = step_lib.make_eval_step(model, jax.tree.map(lambda x: x.sharding, params), batch_sharding)
  eval_data = global_stream.TokenizedEvalData(config, batch_sharding, split="validation")
  with logical_rules.activate(device_mesh, config.mesh.rules):  # as the trainer traces its eval
    return evaluation.evaluate(config, params, eval_fn, eval_data)

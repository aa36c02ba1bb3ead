"""The kernels the step calls, chosen before it compiles: the step's kernel op calls read from one trace of it, and
those the device's autotune table lacks measured (sparsetx/plan/autotune.py) within the start's budget.

More: docs/modules.md, sparsetx/train/step_kernels.py.
"""

from sparsetx.data.batches import abstract_batch
from sparsetx.kernels import registry
from sparsetx.kernels.options import options_from_config
from sparsetx.parallel import logical_rules
from sparsetx.plan import autotune
from sparsetx.train import step


def step_calls(config, built) -> dict:
  """{(op, shape class): call} of every kernel op call the config's train step makes, from one trace of the step
  alone (the model's init, one sequence, is traced by state.setup before), and only calls the autotuner can make
  again."""
  with logical_rules.activate(built.mesh, config.mesh.rules):
    jitted = step.make_train_step(config, built)
    with registry.recording() as calls:
      jitted.trace(built.abstract_state, abstract_batch(config, built.batch_sharding))
  return {found: call for found, call in calls.items() if call is not None and autotune.measurable(call)}


def ensure_tuned(config, built, report=print, budget_s=None) -> dict:
  """Before a step compiles on a GPU or TPU under `auto`: measures the calls the table lacks, within `budget_s`
  (default config.train.autotune_budget_s). Nothing on a CPU (what it runs is XLA's), nothing when the config
  names its kernels."""
  kernel = config.model.ffn.kernel
  if autotune.target().platform == "cpu" or kernel.implementation != "auto":
    return {}
  budget_s = config.train.get("autotune_budget_s", autotune.DEFAULT_BUDGET_S) if budget_s is None else budget_s
  options = options_from_config(kernel)
  calls = step_calls(config, built)
  todo = autotune.missing(calls, options)
  report(
    f"autotune on {autotune.target().device_kind}: {autotune.summary(calls, todo, options)}; budget {budget_s:g} s"
  )
  if not todo:
    return {}
  if budget_s <= 0:
    report(f"autotune: no budget to measure {len(todo)} op shapes: auto takes the default order for them")
    return {}
  autotune.ready_to_measure()
  return autotune.tune_all(todo, options, report, budget_s)

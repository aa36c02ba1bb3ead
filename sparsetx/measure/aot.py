"""Ahead-of-time view of a training run: build abstractly, lower and compile the train step on a
declared mesh, and report what each device holds, moves and computes. No array is allocated.

More: docs/modules.md, sparsetx/measure/aot.py.
"""

import collections
import contextlib
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from sparsetx import config as config_lib
from sparsetx.data.batches import abstract_batch
from sparsetx.models import ladder
from sparsetx.models.ffn import placement
from sparsetx.parallel import logical_rules, topology
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.perf import roofline
from sparsetx.perf.hlo_text import COLLECTIVES, collectives, compiled_kernels, compiled_loops, dcn_granules
from sparsetx.plan.memory import format_bytes
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib
from sparsetx.train.run import compile_cache


def device_bytes(abstract_tree) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest shard)."""
  total = 0
  for leaf in jax.tree.leaves(abstract_tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
  return total


def sparse_table_bytes(abstract_params) -> int:
  """Per-device bytes of the sparse layers' tables (sgatlin/PEER experts, FFF nodes, MoE experts)."""
  names = {"experts", "w_in", "w_out", "wi_gate", "wi_up", "wo"}
  leaves = [
    leaf
    for path, leaf in jax.tree.leaves_with_path(abstract_params)
    if getattr(path[-1], "key", None) in names and any(getattr(p, "key", "") == "mlp" for p in path)
  ]
  return device_bytes(leaves)


@dataclasses.dataclass
class Report:
  mesh_shape: dict
  n_params: int
  param_bytes: int  # per device
  optimizer_bytes: int  # per device
  table_bytes: int  # per device, the sparse layers' tables
  memory: dict  # compiler memory analysis, per device
  model_flops: float  # per step, the whole model (ladder accounting, forward + backward)
  compiled_flops: float  # per step, one device's program (XLA cost analysis)
  collectives: list  # hlo_text.Collective
  bytes_accessed: float = 0.0  # per step, one device's program (XLA cost analysis "bytes accessed")
  tokens_per_step: int = 0  # global batch x sequence length
  loop_param_bytes: int = 0  # per device, the parameters as the per-device microbatch loop takes them (step.py)
  loops: list = dataclasses.field(default_factory=list)  # Loop: each `while` of the compiled program, its trips
  kernels: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # compiled_kernels

  @property
  def peak_bytes(self) -> int:
    """What one device holds at the step's peak: arguments + outputs - aliased (donated) + temporaries."""
    return self.memory["argument"] + self.memory["output"] - self.memory["alias"] + self.memory["temp"]


def abstract_state(config, mesh):
  """(abstract state with shardings, shardings, model, tx); refuses large replicated parameters."""
  built = state_lib.setup(config, mesh=mesh)
  return built.abstract_state, built.shardings, built.model, built.tx


def trace_train_step(config: ml_collections.ConfigDict, mesh):
  """(the train step jitted as the trainer jits it, traced on abstract inputs; the state_lib.Setup)."""
  built = state_lib.setup(config, mesh=mesh)
  jitted = step_lib.make_train_step(config, built)
  return jitted.trace(built.abstract_state, abstract_batch(config, built.batch_sharding)), built


def compile_train_step(config: ml_collections.ConfigDict, mesh):
  """Lowers and compiles the train step for `mesh` from abstract inputs; returns (compiled, state)."""
  compiled, built = _compile_with_setup(config, mesh)
  return compiled, built.abstract_state


def _compile_with_setup(config, mesh):
  """(the compiled train step, the state_lib.Setup it was built from)."""
  with logical_rules.activate(mesh, config.mesh.rules):
    traced, built = trace_train_step(config, mesh)
    compiled = compile_traced(traced, mesh)
  return compiled, built


def compile_traced(traced, mesh):
  """`traced` lowered and compiled; for devices this machine lacks (a topology's), with the persistent cache off
  (compile_cache.off)."""
  deviceless = not set(mesh.devices.flat) <= set(jax.devices())
  with compile_cache.off() if deviceless else contextlib.nullcontext():
    return traced.lower().compile()


# Compiling for a machine this one does not have -----------------------------------------------------------


def topology_mesh(config: ml_collections.ConfigDict, topology_name: str):
  """config.mesh over the devices of a TPU topology or GPU node (parallel/topology.py), checked as the trainer
  checks its mesh; the hosts of a GPU node count as its DCN granules, a TPU slice's as one."""
  return state_lib.checked_mesh(config, topology.devices(topology_name))


def compile_for_topology(config: ml_collections.ConfigDict, topology_name: str):
  """(compiled train step, state_lib.Setup, mesh): the step as the trainer jits it, compiled by the target's own
  compiler (libtpu's, or XLA's GPU compiler with Triton, Mosaic GPU, ptxas and cuDNN) on this machine."""
  mesh = topology_mesh(config, topology_name)
  compiled, built = _compile_with_setup(config, mesh)
  return compiled, built, mesh


# Lowering for a machine this one does not have -------------------------------------------------------------


@contextlib.contextmanager
def on_topology(topology_name: str, n_devices: int = 1):
  """Inside it, programs are traced for the first `n_devices` devices of a topology (parallel/topology.py): the
  kernels and layers take that machine's paths (kernels/platform.target reads the mesh's devices). Yields the
  1-D mesh ('devices') over them."""
  devices = topology.devices(topology_name)[:n_devices]
  mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
  with jax.set_mesh(mesh):
    yield mesh


def lower_train_step(config: ml_collections.ConfigDict, topology_name: str, n_devices: int = 1) -> str:
  """StableHLO text of the train step, as the trainer jits it, lowered for the first `n_devices` devices of a
  topology (config.mesh over them) from abstract inputs. Nothing is compiled: compile_for_topology compiles."""
  mesh = state_lib.checked_mesh(config, topology.devices(topology_name)[:n_devices])
  with logical_rules.activate(mesh, config.mesh.rules):
    traced, _ = trace_train_step(config, mesh)
    return traced.lower().as_text()


def lower_eval_step(config: ml_collections.ConfigDict, topology_name: str, n_devices: int = 1) -> str:
  """StableHLO text of the evaluation step (summed loss of a batch), lowered like lower_train_step."""
  mesh = state_lib.checked_mesh(config, topology.devices(topology_name)[:n_devices])
  with logical_rules.activate(mesh, config.mesh.rules):
    built = state_lib.setup(config, mesh=mesh)
    jitted = step_lib.make_eval_step(built.model, built.shardings.params, built.batch_sharding)
    traced = jitted.trace(built.abstract_state.params, abstract_batch(config, built.batch_sharding))
    return traced.lower().as_text()


def dry_run(config: ml_collections.ConfigDict, mesh, granule_of: dict | None = None) -> Report:
  """Compiles the train step for `mesh` and reports it; `granule_of` (device id -> node / slice,
  mesh_lib.granule_of) marks the collectives that cross the DCN."""
  compiled, built = _compile_with_setup(config, mesh)
  return report_of(compiled, built, config, mesh, granule_of)


def report_of(compiled, built, config: ml_collections.ConfigDict, mesh, granule_of: dict | None = None) -> Report:
  """The Report of a compiled train step (its compiler's memory and cost analyses, its program) and the
  state_lib.Setup it was built from."""
  abstract = built.abstract_state
  memory = compiled.memory_analysis()
  memory = {
    name: int(getattr(memory, f"{name}_size_in_bytes", 0) or 0)
    for name in ("argument", "output", "temp", "alias", "generated_code")
  }
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  tokens = config.data.global_batch_size * config.data.seq_len
  text = compiled.as_text()
  return Report(
    mesh_shape=dict(mesh.shape),
    n_params=sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract.params)),
    param_bytes=device_bytes(abstract.params),
    optimizer_bytes=device_bytes(abstract.opt_state),
    table_bytes=sparse_table_bytes(abstract.params),
    memory=memory,
    model_flops=3.0 * ladder.forward_flops_per_token(config.model, config.data.seq_len)["total"] * tokens,
    compiled_flops=float((cost or {}).get("flops", 0.0)),
    collectives=collectives(text, dcn_granules(mesh, granule_of) if granule_of else None),
    bytes_accessed=float((cost or {}).get("bytes accessed", 0.0)),
    tokens_per_step=tokens,
    loop_param_bytes=step_lib.loop_param_bytes(config, built.model, abstract.params, mesh),
    loops=compiled_loops(text),
    kernels=compiled_kernels(text),
  )


def _pallas_calls(jaxpr, scope: str = ""):
  """(equation, its name scope) of every pallas_call of a jaxpr and the jaxprs nested in it (shard_map bodies,
  loops, checkpoints); a nested jaxpr's scopes are relative to its equation's."""
  for eqn in jaxpr.eqns:
    here = f"{scope}/{eqn.source_info.name_stack}"
    if eqn.primitive.name == "pallas_call":
      yield eqn, here
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _pallas_calls(inner, here)


def rejected_kernel(config: ml_collections.ConfigDict, mesh) -> tuple[str, str] | None:
  """(layer, kernel) of the first Pallas kernel of the step that the target's compiler refuses on its own, each
  compiled at the shapes one device sees; None when every kernel compiles (the refusal is elsewhere)."""
  with logical_rules.activate(mesh, config.mesh.rules):
    traced, _ = trace_train_step(config, mesh)
  one_device = jax.sharding.Mesh(np.array(mesh.devices.flat[:1]), ("devices",))
  seen = set()
  for eqn, scope in _pallas_calls(traced.jaxpr.jaxpr):
    name = eqn.params["name"]
    shapes = tuple((v.aval.shape, v.aval.dtype) for v in eqn.invars)
    if (name, shapes) in seen:
      continue
    seen.add((name, shapes))
    layer = next((part for part in scope.split("/") if part.startswith("layers_")), "")
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    try:
      with jax.set_mesh(one_device):
        compile_traced(jax.jit(lambda *a, eqn=eqn: eqn.primitive.bind(*a, **eqn.params)).trace(*args), one_device)
    except Exception:  # noqa: BLE001  (this kernel is the one refused)
      return layer or "the model", name
  return None


def describe_rejection(error: BaseException, topology_name: str, at: tuple[str, str] | None = None) -> str:
  """One line for a compiler's refusal of the step: the layer and kernel refused (rejected_kernel) and the
  compiler's own first line."""
  message = str(error)
  first = next((line.strip() for line in message.splitlines() if line.strip()), type(error).__name__)
  where = f" at {at[0]}'s {at[1]} kernel" if at else ""
  return f"the compiler for {topology_name} rejected the train step{where}: {first}"


def format_compiled_memory(report: Report, chip=None) -> str:
  """The compiler's per-device memory of the step, and its peak against the chip's HBM."""
  memory = report.memory
  lines = [
    "per-device memory, as compiled for the target (its compiler's memory analysis):",
    f"  arguments {format_bytes(memory['argument'])}, temporaries {format_bytes(memory['temp'])}, outputs "
    f"{format_bytes(memory['output'])}, aliased {format_bytes(memory['alias'])}",
  ]
  peak = f"  peak {format_bytes(report.peak_bytes)}"
  if chip is not None and chip.hbm_bytes:
    peak += f" of {chip.name}'s {format_bytes(chip.hbm_bytes)} HBM ({report.peak_bytes / chip.hbm_bytes:.0%})"
  return "\n".join([*lines, peak])


def format_program(report: Report) -> str:
  """The compiled program's loops (trip counts) and the kernels it launches."""
  trips = ", ".join(str(loop.trips) if loop.trips is not None else "?" for loop in report.loops) or "none"
  lines = [f"loops of the compiled program (trips): {trips}", "kernels the step launches:"]
  calls = collections.Counter()
  for (target, name), count in report.kernels.items():
    if target.startswith(("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu", "__cudnn")):
      calls[target, name] += count
  lines += [f"  {target:<40}{name or '-':<40}{count:>5}" for (target, name), count in sorted(calls.items())]
  if not calls:
    lines.append("  (none: XLA's own code)")
  return "\n".join(lines)


def remat_rows(config: ml_collections.ConfigDict, mesh, policies=config_lib.REMAT_POLICIES) -> list:
  """(policy, per-device temp bytes, compiled FLOPs per device) of the train step under each config.model.remat
  policy: the memory a policy saves and the recomputation it costs (sparsetx/tools/dry_run.py --remat_sweep)."""
  rows = []
  for policy in policies:
    variant = config.copy_and_resolve_references()
    variant.model.remat = policy
    compiled, _ = compile_train_step(config_lib.validate(variant), mesh)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    rows.append((policy, int(compiled.memory_analysis().temp_size_in_bytes), float((cost or {}).get("flops", 0.0))))
  return rows


def format_report(report: Report) -> str:
  mesh = " x ".join(f"{axis}={size}" for axis, size in report.mesh_shape.items())
  lines = [
    f"mesh                      {mesh} ({math.prod(report.mesh_shape.values())} devices)",
    f"parameters                {report.n_params:,} ({report.n_params / 1e6:,.2f} M)",  # B rounded 4.7M to 0.00
    "per device:",
    f"  parameters              {format_bytes(report.param_bytes)}",
    f"  optimizer state         {format_bytes(report.optimizer_bytes)}",
    f"  sparse tables           {format_bytes(report.table_bytes)}",
    "compiler memory analysis (per device):",
  ]
  lines += [f"  {name:<22}  {format_bytes(value)}" for name, value in report.memory.items()]
  lines += [
    f"model FLOPs per step      {report.model_flops:.3e} (ladder accounting, forward + backward)",
    f"compiled FLOPs per device {report.compiled_flops:.3e} (XLA cost analysis, one device; a loop body such as micro-batches counts once)",
    "collectives (static instructions in the compiled program; loop bodies listed once):",
    f"  {'op':<20}{'count':>7}{'total bytes':>14}{'largest':>12}  group sizes",
  ]
  by_op = collections.defaultdict(list)
  for c in report.collectives:
    by_op[c.op].append((c.nbytes, c.group))
  for op in COLLECTIVES:
    if op in by_op:
      sizes = [b for b, _ in by_op[op]]
      groups = ",".join(str(g) for g in sorted({g for _, g in by_op[op]}))
      lines.append(f"  {op:<20}{len(sizes):>7}{format_bytes(sum(sizes)):>14}{format_bytes(max(sizes)):>12}  {groups}")
  if not by_op:
    lines.append("  (none)")
  crossing = [c for c in report.collectives if c.granules > 1]
  if crossing:
    sent = sum(roofline.dcn_bytes(c.op, c.nbytes, c.group, c.granules) for c in crossing)
    spans = ",".join(str(k) for k in sorted({c.granules for c in crossing}))
    lines.append(
      f"  over the DCN: {len(crossing)} of them span {spans} nodes / slices; {format_bytes(sent)} sent per device over"
      " the DCN (hierarchical, roofline.dcn_bytes)"
    )
  return "\n".join(lines)


def dcn_granule_count(config) -> int | None:
  """The simulated nodes / slices of config.mesh.dcn when its sizes are all given and their product is > 1
  (a dry run on one process's devices); None otherwise (the processes / slices present are the granules)."""
  sizes = [config.mesh.dcn[a] for a in config_lib.MESH_AXES]
  return math.prod(sizes) if -1 not in sizes and math.prod(sizes) > 1 else None


def table_bytes_by_expert(config: ml_collections.ConfigDict, devices, expert_sizes) -> list:
  """(expert axis size, per-device sparse table bytes) from abstract parameter shapes only.

  data takes the other devices; the replication check is skipped, since at expert=1 a large table
  is replicated on purpose here, to show the baseline.
  """
  model = state_lib.build_model(config)
  tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
  boxed = jax.eval_shape(lambda rng: model.init(rng, tokens)["params"], jax.random.key(0))
  specs = nn.get_partition_spec(boxed)
  rows = []
  for expert in expert_sizes:
    if len(devices) % expert:
      continue
    mesh_config = ml_collections.ConfigDict(config.mesh.to_dict())
    mesh_config.ici.update(data=-1, fsdp=1, tensor=1, expert=expert)
    mesh_config.dcn.update(data=1, fsdp=1, tensor=1, expert=1)
    mesh = mesh_lib.make_mesh(mesh_config, devices)
    placement.check_units_divide(config, mesh)
    shardings = mesh_lib.logical_sharding(specs, mesh, config.mesh.rules)
    abstract = jax.tree.map(
      lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), nn.unbox(boxed), shardings
    )
    rows.append((expert, sparse_table_bytes(abstract)))
  return rows


__all__ = [
  "Report",
  "dry_run",
  "format_report",
  "device_bytes",
  "table_bytes_by_expert",
  "on_topology",
  "compile_for_topology",
  "lower_train_step",
  "lower_eval_step",
]

"""Dry run: compile a config's train step for a declared mesh on simulated CPU devices, allocating nothing.

  .venv/bin/python -m sparsetx.tools.dry_run --config=configs/large.py:sgatlin8,h100 --devices=64
  .venv/bin/python -m sparsetx.tools.dry_run --config=configs/large.py:sgatlin8,h100 --target=h100 \
      --chips=1024,8192 --save_cadence_only  # how often to save (plan/save_cadence.py), no compile
  .venv/bin/python -m sparsetx.tools.dry_run --config=configs/ladder.py:sgatlin,8 --devices=64 \
      --config.mesh.ici.data=8 --config.mesh.ici.fsdp=2 --config.mesh.ici.expert=4 \
      --config.data.global_batch_size=64 --config.data.eval_batch_size=64

More: docs/modules.md, sparsetx/tools/dry_run.py.
"""

import time

import jax
from absl import flags

from sparsetx import cli, hardware, paths
from sparsetx import config as config_lib
from sparsetx.data import check_files
from sparsetx.kernels import autotune_table
from sparsetx.measure import aot
from sparsetx.models import transformer
from sparsetx.models.ffn.registry import SPECS
from sparsetx.parallel import logical_rules, topology
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.perf import roofline
from sparsetx.plan import memory, save_cadence, step_cost, targets
from sparsetx.train import state as state_lib
from sparsetx.train.run import goodput


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    config=cli.define_config_file("config", "configs/tiny.py", "Config file, optionally with ':ARG'."),
    devices=flags.DEFINE_integer("devices", 8, "Simulated CPU devices (the mesh's size)."),
    expert_sweep=flags.DEFINE_list("expert_sweep", [], "Expert-axis sizes for a per-device sparse-table bytes table."),
    target=flags.DEFINE_enum(
      "target", "all", [*hardware.CHIPS, "all"], "Chip of the projected step time (roofline), or all of them."
    ),
    remat_sweep=flags.DEFINE_bool(
      "remat_sweep", False, "Also compile the step with every config.model.remat policy and print its temp memory."
    ),
    topology=flags.DEFINE_string(
      "topology",
      "auto",
      "Compile with the target's own compiler for a TPU topology (v5p:2x2x1, v6e:2x2, v5p:4x4x2) or GPU node "
      "(h100:1x1x8, h200:1x1x8, a100:1x2x8: slices x hosts x GPUs); auto: the config's target "
      "(configs/ladder.py:TYPE,SCALE,TARGET), else cpu; cpu: the simulated CPU devices of --devices.",
    ),
    split_d_model=flags.DEFINE_bool(
      "split_d_model", False, "Split neuron tables by d_model over the expert axis (D_MODEL_SPLIT_RULES first)."
    ),
    chips=cli.define_integer_list(
      "chips",
      [],
      "Chip counts of a save-cadence table (e.g. 1024,8192): the checkpoint.every_minutes that maximises the "
      "expected goodput under random failures, next to the configured one's (README, 'How often to save').",
    ),
    chip_mtbf_hours=flags.DEFINE_float(
      "chip_mtbf_hours",
      save_cadence.LLAMA3_CHIP_MTBF_HOURS,
      "One chip's mean time between failures, hours (default: Llama 3's report, 419 interruptions in 54 days on "
      "16,384 H100s).",
    ),
    costs_from=flags.DEFINE_string(
      "costs_from",
      "",
      "A workdir whose goodput.json measured the save, restart and step times (the cadence uses their means); "
      "empty: the plan's estimates for the config on --target's chips.",
    ),
    save_cadence_only=flags.DEFINE_bool(
      "save_cadence_only", False, "Print the save-cadence table of --chips and stop before compiling anything."
    ),
  )


def with_d_model_split(config):
  """A copy of config whose rules split neuron tables by d_model over fsdp x expert."""
  config = config.copy_and_resolve_references()
  config.mesh.rules = logical_rules.D_MODEL_SPLIT_RULES + tuple(tuple(rule) for rule in config.mesh.rules)
  return config


def sweep_table_bytes(config, devices, expert_sizes) -> list:
  """(expert, per-device table bytes, layout): tables split by unit, or by d_model where the units are too few."""
  rows = []
  for expert in expert_sizes:
    ffn = config.model.ffn
    spec = SPECS[ffn.type]  # units that a d_model split can stand in for: a neuron table split by unit
    units = ffn[spec.units.field] if spec.units is not None and spec.neuron_table is not None else None
    if units is not None and expert > units and expert % units == 0:
      sized = aot.table_bytes_by_expert(with_d_model_split(config), devices, [expert])
      rows += [(e, nbytes, "d_model") for e, nbytes in sized]
    else:
      rows += [(e, nbytes, "units") for e, nbytes in aot.table_bytes_by_expert(config, devices, [expert])]
  return rows


def print_remat_rows(rows) -> None:
  """Temp memory and recompute cost per policy, relative to no remat (what a policy trades)."""
  base = dict((policy, (temp, flops)) for policy, temp, flops in rows).get("none", (rows[0][1], rows[0][2]))
  print("train step per remat policy (config.model.remat; compiler memory analysis, one device):")
  print(f"  {'policy':<34}{'temp MiB':>10}{'x none':>8}{'FLOPs':>12}{'x none':>8}")
  for policy, temp, flops in rows:
    print(
      f"  {policy:<34}{temp / 2**20:>10.1f}{temp / max(base[0], 1):>8.2f}{flops:>12.3e}{flops / max(base[1], 1):>8.2f}"
    )


def resolve_topology(flag: str, config) -> str:
  """The topology to compile for: the flag's, or with auto the config's target's (cpu when it has none)."""
  if flag != "auto":
    return flag
  target = config.mesh.get("target", "")
  return targets.topology_name(target) if target else "cpu"


def cadence_chip(target_flag: str, config) -> str:
  """The chip the estimated save cadence sizes the run on: --target's, else config.mesh.target's."""
  if target_flag != "all":
    return target_flag
  target = config.mesh.get("target", "")
  if not target:
    raise config_lib.ConfigError(
      "the estimated save cadence needs the chip the run trains on: give --target (e.g. --target=h100), set "
      "config.mesh.target, or give --costs_from=WORKDIR to use a run's measured costs."
    )
  return next(chip for chip in hardware.TARGET_CHIPS if targets.parse(target).chip is hardware.CHIPS[chip])


def save_cadence_table(config, args, compile_s: float | None = None) -> str:
  """The save-cadence table of --chips: from --costs_from's measured costs, else the plan's estimates (with the
  compile this dry run measured, `compile_s`, in place of the assumed one)."""
  if any(chips < 1 for chips in args.chips) or args.chip_mtbf_hours <= 0:
    raise config_lib.ConfigError(
      f"--chips={','.join(map(str, args.chips))} and --chip_mtbf_hours={args.chip_mtbf_hours:g} must be > 0."
    )
  if args.costs_from:
    costs = save_cadence.read_costs(paths.resolve(args.costs_from) / goodput.RECORD)
    rows = [save_cadence.cadence_row(config, n, args.chip_mtbf_hours, costs) for n in args.chips]
  else:
    chip = cadence_chip(args.target, config)
    rows = [
      save_cadence.cadence_row(
        config, n, args.chip_mtbf_hours, *save_cadence.estimated_costs(config, chip, n, compile_s)
      )
      for n in args.chips
    ]
  return save_cadence.format_table(rows, args.chip_mtbf_hours, config.checkpoint)


def layers_line(config) -> str:
  """How the compiled step runs its layers (what its compile time grows with): one loop per layer, or scanned by
  groups of like layers (config.model.scan_layers; docs/measurements.md compares them against depth)."""
  model = config.model
  if not transformer.scans_layers(model):
    return f"{model.n_layers} layers, one by one"
  groups = transformer.layer_groups(model)
  return f"{model.n_layers} layers scanned in {len(groups)} group(s) of {', '.join(str(len(g)) for g in groups)}"


def compile_on_topology(config, name: str) -> float:
  """Compiles the step for a topology's devices with its compiler and prints what the compiler decided: memory,
  FLOPs, collectives, loops, kernels, and the step projected on its chip; returns the compile's seconds. A rejection
  is one `error:` line."""
  devices = topology.devices(name)
  chip = hardware.chip_of(devices[0].device_kind)
  if chip is not None:  # the topology's chip sizes what may stay replicated, as a target's does
    targets.size_replication_limit(config, chip)
  mesh = state_lib.checked_mesh(config, devices)
  start = time.time()
  try:
    report = aot.dry_run(config, mesh, mesh_lib.granule_of(devices))
  except config_lib.ConfigError:
    raise
  except Exception as error:  # the compiler's refusal: Mosaic, Triton, ptxas or XLA itself
    cli.fail(aot.describe_rejection(error, name, aot.rejected_kernel(config, mesh)))
  print(aot.format_report(report))
  print(aot.format_compiled_memory(report, chip))
  estimate = memory.device_memory(config, mesh, report).device
  print(
    f"  analytic estimate {memory.format_bytes(estimate)} ({estimate / max(report.peak_bytes, 1):.2f} x the compiled peak)"
  )
  print(aot.format_program(report))
  seconds = time.time() - start
  print(
    f"compiled for {name} ({devices[0].device_kind}, {len(devices)} devices) in {seconds:.0f} s ({layers_line(config)})"
  )
  if topology.is_gpu(name):
    print(topology.GPU_COMPILE_NOTE)
  if chip is None:
    return seconds
  if report.compiled_flops > 0 and report.bytes_accessed > 0:
    print(roofline.format_projections([roofline.project(report, chip)]))
  else:
    print(NO_COMPILED_COST_NOTE)
    print_analytic(config, mesh, [chip], report)
  return seconds


NO_COMPILED_COST_NOTE = (
  "the compiler reports no FLOPs or bytes for this program (a GPU compiled without a device): the step below is "
  "projected from the analytic model (plan/layer_cost.py) with the compiled collectives."
)


def print_analytic(config, mesh, chips, report=None) -> None:
  """The per-layer analytic table (layer_cost.py) and the step projected from it: what the accelerator kernels
  move and compute, which the CPU-compiled program's counts cannot show. With a compiled `report`, its
  collectives outside the feed-forward layers join the projection."""
  mesh_shape = dict(mesh.shape)
  print(step_cost.format_placements(config, mesh_shape))
  print(step_cost.format_config_layers(config, mesh_shape, chips))
  rest = roofline.outside_ffn(report.collectives) if report is not None else ()
  projections = [step_cost.project_step(config, mesh_shape, chip, rest) for chip in chips]
  title = roofline.ANALYTIC_TITLE
  if report is None:
    title = title.replace(roofline.LOWERED_ONLY, roofline.LOWERED_ONLY_NOTE)
  print(roofline.format_projections(projections, title))


def absl_main(argv, holders: dict):
  del argv
  args = cli.flag_values(holders)
  jax.config.update("jax_platforms", "cpu")  # simulated CPU devices; a topology compiles without its chips
  jax.config.update("jax_num_cpu_devices", args.devices)  # set before anything starts the backend
  config = with_d_model_split(args.config) if args.split_d_model else args.config
  try:
    if (args.save_cadence_only or args.costs_from) and not args.chips:
      raise config_lib.ConfigError(
        "--save_cadence_only and --costs_from size the save cadence for --chips; give them, e.g. --chips=1024,8192."
      )
    if args.chips:  # before the compile: a bad workdir or chip count is refused in seconds, not after it
      cadence = save_cadence_table(config_lib.validate(config), args)
      if args.save_cadence_only:
        print(cadence)
        return
    check_files(config_lib.validate(config))
    name = resolve_topology(args.topology, config)
    with autotune_table.used(config.train.autotune):  # the kernels a trained step would take
      if name != "cpu":
        compile_s = compile_on_topology(config, name)
        if args.chips:
          print(save_cadence_table(config, args, compile_s))
        return
      devices = jax.devices()[: args.devices]
      granules = aot.dcn_granule_count(config)
      mesh = state_lib.checked_mesh(config, devices, granules)
      start = time.time()
      report = aot.dry_run(config, mesh, mesh_lib.granule_of(devices, granules))
      compile_s = time.time() - start
  except config_lib.ConfigError as error:
    cli.fail(error)
  print(aot.format_report(report))
  print(memory.format_device_memory(memory.device_memory(config, mesh, report), hardware.chips(args.target)))
  print(f"lowered and compiled in {compile_s:.0f} s ({layers_line(config)})")
  print(roofline.format_projections([roofline.project(report, chip) for chip in hardware.chips(args.target)]))
  print_analytic(config, mesh, hardware.chips(args.target), report)
  if args.remat_sweep:
    print_remat_rows(aot.remat_rows(config, mesh))
  if args.expert_sweep:
    print("sparse tables per device by expert-axis size (data takes the other devices):")
    print(f"  {'expert':>6}  {'bytes':>14}  {'x expert':>14}  split by")
    try:
      rows = sweep_table_bytes(args.config, devices, [int(e) for e in args.expert_sweep])
    except config_lib.ConfigError as error:
      cli.fail(error)
    for expert, nbytes, layout in rows:
      print(f"  {expert:>6}  {nbytes:>14,}  {nbytes * expert:>14,}  {layout}")
  if args.chips:  # with the compile this run measured in place of the assumed one
    try:
      print(save_cadence_table(config, args, compile_s))
    except config_lib.ConfigError as error:
      cli.fail(error)


def main():
  """The `sparsetx-dry-run` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()

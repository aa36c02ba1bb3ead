"""Export's and import's host memory and speed at two model sizes: `python -m sparsetx.tools.bench_export`.

For each model (the tiny baseline, then the ladder's sgatlin rungs 2 and 4: 80M and 599M parameters, on tiny's
data) a checkpoint with its full train state is written, exported and imported back, each in a child process of its
own, with a cap small enough that the largest spans at least 8 shards. One table, side by side: each export's and
import's peak RSS above the baseline's (the same of the tiny model: the program's own imports and constants),
divided by the cap plus the model's largest tensor (the bound: at most 1.5), and the throughputs beside a raw
safetensors write of the same tensors in the same shards.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import safetensors.numpy
from absl import flags

from sparsetx import cli
from sparsetx.config import ConfigError

MODELS = {  # name -> (config file argument, ladder rung or None)
  "tiny": ("configs/tiny.py:sgatlin", None),
  "sgatlin2": ("configs/tiny.py:sgatlin", "sgatlin,2"),
  "sgatlin4": ("configs/tiny.py:sgatlin", "sgatlin,4"),
}


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    models=flags.DEFINE_list("models", ["sgatlin2", "sgatlin4"], f"Models beside the tiny baseline: {list(MODELS)}."),
    max_shard_size=flags.DEFINE_string("max_shard_size", "256MB", "The export's shard cap."),
    scratch=flags.DEFINE_string("scratch", None, "Directory for the checkpoints and exports (default: a temp)."),
    child=flags.DEFINE_string(
      "child", None, "Internal: export,WORKDIR,OUT or import,HF_DIR,WORKDIR here and print the measurements."
    ),
  )


def model_config(name: str):
  """The full config of a model of MODELS: tiny's data and training, the ladder rung's model."""
  config_arg, rung = MODELS[name]
  config = cli.load_config_file("config", config_arg)
  if rung is not None:
    config.model = cli.load_config_file("config", f"configs/ladder.py:{rung}").model
    config.model.remat = "none"
  return config


def write_checkpoint(config, workdir: str) -> None:
  """A step-1 checkpoint of a fresh model with its full train state (parameters and both Adam moments)."""
  from sparsetx.train import state as state_lib  # noqa: PLC0415
  from sparsetx.train.checkpoints import checkpointing  # noqa: PLC0415

  mesh = state_lib.single_device_mesh(config)
  _, shardings, model, tx = state_lib.state_shardings(config, mesh)
  state = state_lib.create_state(config, shardings, model, tx)
  checkpointer = checkpointing.Checkpointer(workdir, config.checkpoint)
  checkpointer.save(1, state, config, data_state=None)
  checkpointer.close()


def peak_rss() -> int:
  """This process's peak resident bytes since its exec (VmHWM; ru_maxrss would count the parent's RSS at fork)."""
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def child_run(kind: str, source: str, target: str, max_shard_size: str) -> dict:
  """Exports (a workdir to an HF directory) or imports (back to a new workdir) in this process; its peak RSS, the
  seconds and the bytes written."""
  from sparsetx.hf import export  # noqa: PLC0415

  began = time.perf_counter()
  if kind == "export":
    summary = export.export(source, target, max_shard_size=max_shard_size)
  else:
    summary = export.import_hf(source, target, max_shard_size=max_shard_size)
    summary.pop("config")
  return dict(summary, seconds=time.perf_counter() - began, peak_rss=peak_rss())


def measured(kind: str, source: str, target: str, max_shard_size: str) -> dict:
  """child_run in a new process (its peak RSS is its own)."""
  command = [sys.executable, "-m", "sparsetx.tools.bench_export", f"--child={kind},{source},{target}"]
  result = subprocess.run([*command, f"--max_shard_size={max_shard_size}"], capture_output=True, text=True)
  if result.returncode:
    raise RuntimeError(f"{kind} of {source} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def raw_write_seconds(shapes: dict, cap: int, directory: str) -> float:
  """Seconds safetensors takes to write float32 tensors of `shapes` in the same shards, from memory."""
  from sparsetx.hf import shards  # noqa: PLC0415

  rng = np.random.default_rng(0)
  tensors = {name: rng.standard_normal(shape, np.float32) for name, shape in shapes.items()}
  files = shards.plan({name: t.nbytes for name, t in tensors.items()}, cap)
  began = time.perf_counter()
  for file, names in files.items():
    safetensors.numpy.save_file({n: tensors[n] for n in names}, os.path.join(directory, file), {"format": "pt"})
  return time.perf_counter() - began


def hf_shapes(config) -> dict:
  from sparsetx.hf import export, lazy_tensors  # noqa: PLC0415

  _, tensors = export.mapping_for(config.model).hf_tensors(config.model)
  return lazy_tensors.shapes(tensors, lazy_tensors.param_shapes(config.model))


def measure(names: list[str], max_shard_size: str, scratch: str, report=print) -> dict:
  """{model: the row of the table}; the tiny baseline first."""
  from sparsetx.hf import shards  # noqa: PLC0415

  cap = shards.parse_size(max_shard_size)
  rows = {}
  for name in ["tiny", *names]:
    config = model_config(name)
    workdir, out = os.path.join(scratch, name, "run"), os.path.join(scratch, name, "hf")
    write_checkpoint(config, workdir)
    shapes = hf_shapes(config)
    largest = max(4 * math.prod(shape) for shape in shapes.values())
    found = measured("export", workdir, out, max_shard_size)
    imported = measured("import", out, os.path.join(scratch, name, "imported"), max_shard_size)
    raw_dir = os.path.join(scratch, name, "raw")
    os.makedirs(raw_dir)
    raw = raw_write_seconds(shapes, cap, raw_dir)
    shutil.rmtree(os.path.join(scratch, name))  # the next model's disk
    row = dict(
      parameters=sum(math.prod(shape) for shape in shapes.values()),
      largest_tensor=largest,
      shards=found["shards"],
      peak_rss=found["peak_rss"],
      export_gb_s=found["bytes"] / found["seconds"] / 1e9,
      read_gb_s=found["bytes"] / found["read_seconds"] / 1e9,
      write_gb_s=found["bytes"] / found["write_seconds"] / 1e9,
      raw_gb_s=found["bytes"] / raw / 1e9,
      import_peak_rss=imported["peak_rss"],
      import_gb_s=imported["bytes"] / imported["seconds"] / 1e9,
    )
    if name != "tiny":
      row["rss_over_bound"] = (found["peak_rss"] - rows["tiny"]["peak_rss"]) / (cap + largest)
      row["import_rss_over_bound"] = (imported["peak_rss"] - rows["tiny"]["import_peak_rss"]) / (cap + largest)
    rows[name] = row
    report(f"{name}: {json.dumps(row)}")
  return rows


def table(rows: dict, cap: int) -> str:
  lines = [
    f"shard cap {cap / 1e6:.0f} MB. above/bound: peak RSS above the tiny model's (its export, its import) over (cap + "
    "largest tensor), at most 1.5. GB/s of the weights: the whole export; its reading (orbax, decompressing) and its "
    "writing; a raw safetensors write of the same tensors in the same shards; write / raw; the whole import",
    f"{'model':9} {'params':>7} {'largest':>8} {'shards':>6} {'peak RSS':>9} {'above/bound':>11} "
    f"{'export':>7} {'read':>7} {'write':>7} {'raw':>7} {'ratio':>6} | {'import RSS':>10} {'above/bound':>11} "
    f"{'import':>7}",
  ]
  for name, row in rows.items():
    above, import_above = (
      (f"{row['rss_over_bound']:.2f}", f"{row['import_rss_over_bound']:.2f}")
      if "rss_over_bound" in row
      else ("baseline", "baseline")
    )
    lines.append(
      f"{name:9} {row['parameters'] / 1e6:6.0f}M {row['largest_tensor'] / 1e6:6.0f}MB {row['shards']:6d} "
      f"{row['peak_rss'] / 2**30:6.2f}GiB {above:>11} {row['export_gb_s']:7.2f} {row['read_gb_s']:7.2f} "
      f"{row['write_gb_s']:7.2f} {row['raw_gb_s']:7.2f} {row['write_gb_s'] / row['raw_gb_s']:6.2f} | "
      f"{row['import_peak_rss'] / 2**30:7.2f}GiB {import_above:>11} {row['import_gb_s']:7.2f}"
    )
  return "\n".join(lines)


def absl_main(argv, holders: dict) -> None:
  del argv
  args = cli.flag_values(holders)
  try:
    if args.child:
      kind, source, target = args.child.split(",")
      print(json.dumps(child_run(kind, source, target, args.max_shard_size)))
      return
    unknown = [name for name in args.models if name not in MODELS or name == "tiny"]
    if unknown:
      raise ConfigError(f"--models={','.join(args.models)}: unknown {unknown}; use {list(MODELS)[1:]}.")
    from sparsetx.hf import shards  # noqa: PLC0415

    cap = shards.parse_size(args.max_shard_size)
    with tempfile.TemporaryDirectory(prefix="bench-export-", dir=args.scratch) as scratch:
      rows = measure(args.models, args.max_shard_size, scratch)
    print(table(rows, cap))
  except ConfigError as error:
    cli.fail(error)


def main():
  """The `sparsetx-bench-export` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()

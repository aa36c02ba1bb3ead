"""How often to save: the checkpoint interval that maximises the expected goodput of a run that fails at random,
from a workdir's measured costs or the plan's estimates (sparsetx-dry-run --chips=...; README, "How often to save").

The model is Daly's (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
Future Generation Computer Systems 22(3):303-312, 2006): failures arrive as a Poisson process of mean time M between
them (the system's MTBF: a chip's over the chips), each save blocks the run for delta seconds, a restart costs R
seconds (init, restore and compile, until the first step finishes), and tau seconds of work run between saves. The
expected wall time per unit of work is M e^(R/M) (e^((tau + delta)/M) - 1) / tau, so the expected goodput (work over
wall time) is its inverse. Young's sqrt(2 delta M) (1974) is the first-order optimum and Daly's closed form its
higher-order one; the table prints both beside the numeric optimum, which needs neither expansion.
"""

import dataclasses
import json
import math

import numpy as np

from sparsetx import config as config_lib
from sparsetx import hardware
from sparsetx.models import ladder
from sparsetx.models.ffn.registry import SPECS
from sparsetx.plan import step_cost, targets

# Llama 3's report (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4) counts 419 unexpected
# interruptions in 54 days of pre-training on 16,384 H100 GPUs: one per 54 x 24 x 16,384 / 419 hours of one GPU.
LLAMA3_CHIP_MTBF_HOURS = 54 * 24 * 16384 / 419  # about 50,677 h

# The estimated costs (no workdir measured them). Each is a published figure or a stated assumption; the table labels
# every figure derived from them "estimated".
# Device to host: PCIe 5.0 x16 (PCI-SIG: 32 GT/s x 16 lanes, 128b/130b coding) is 63 GB/s one way, the host link of
# an H100 SXM (its datasheet: PCIe Gen5, 128 GB/s both ways); each chip copies its shards over its own link, and the
# host's memory (a DGX H100's two Xeon 8480C sockets of 8 DDR5-4800 channels, 614 GB/s) takes its 8 links at once.
# Line rate: an optimistic figure (a lower bound on the blocking save), taken for every chip.
HOST_COPY_BYTES_PER_S = 32e9 * 16 * 128 / 130 / 8
# Storage: Llama 3's report (section 3.3.1) gives the storage fabric of its pre-training (Tectonic, 240 PB on 7,500
# servers) a sustained throughput of 2 TB/s (7 TB/s peak) for the 16,384 GPUs; a restore shares it among the hosts,
# each also capped by its NICs (the chip table's DCN line rate per chip, sparsetx/hardware.py).
STORAGE_READ_BYTES_PER_S = 2e12
# Assumed, not measured (no pod figure in this repo): starting the processes, jax.distributed's rendezvous, the
# corpus and the abstract model before the restore begins.
INIT_SECONDS = 120.0
# Assumed: the first step's compile on a pod takes minutes (README, "Hangs, restarts, preemption"); the watchdog's
# 300 s floor is sized to cover it. A dry run that compiles measures its own (simulated devices') compile instead.
COMPILE_SECONDS = 300.0


# The model ------------------------------------------------------------------------------------------------------


def system_mtbf_seconds(chips: int, chip_mtbf_hours: float) -> float:
  """M: independent chips, each failing at random, fail as one system `chips` times as often."""
  return chip_mtbf_hours * 3600.0 / chips


def log_goodput(tau, save_s: float, restart_s: float, mtbf_s: float):
  """The log of `goodput`, finite wherever tau > 0: log tau - log M - R/M - log(e^x - 1), x = (tau + delta)/M, with
  log(e^x - 1) as x + log(1 - e^-x) once e^x would overflow (a restart or interval of hundreds of MTBFs)."""
  tau = np.asarray(tau, dtype=np.float64)
  x = (tau + save_s) / mtbf_s
  log_expm1 = np.where(x > 30.0, x + np.log1p(-np.exp(-np.minimum(x, 700.0))), np.log(np.expm1(np.minimum(x, 30.0))))
  return np.log(tau) - math.log(mtbf_s) - restart_s / mtbf_s - log_expm1


def goodput(tau, save_s: float, restart_s: float, mtbf_s: float):
  """Daly's expected goodput: tau / (M e^(R/M) (e^((tau + delta)/M) - 1)) (numpy arrays too; 0 where it
  underflows)."""
  return np.exp(log_goodput(tau, save_s, restart_s, mtbf_s))


def optimal_interval(save_s: float, restart_s: float, mtbf_s: float) -> float:
  """The tau that maximises `goodput`, numerically: a log-spaced grid over [min(delta, M) / 10, 10 M] (the optimum
  lies in [M (1 - e^(-delta/M)), M]) and a golden-section search between the best point's neighbours."""
  if save_s <= 0:
    raise config_lib.ConfigError(f"a blocking save of {save_s!r} s leaves no optimum; the save cost must be > 0.")
  grid = np.geomspace(min(save_s, mtbf_s) / 10, 10 * mtbf_s, 4001)
  best = int(np.argmax(log_goodput(grid, save_s, restart_s, mtbf_s)))  # the same argmax, and no underflow
  lo, hi = math.log(grid[max(best - 1, 0)]), math.log(grid[min(best + 1, len(grid) - 1)])
  ratio = (math.sqrt(5) - 1) / 2

  def value(log_tau: float) -> float:
    return float(log_goodput(math.exp(log_tau), save_s, restart_s, mtbf_s))

  a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
  fa, fb = value(a), value(b)
  for _ in range(200):
    if hi - lo < 1e-12:
      break
    if fa < fb:
      lo, a, fa = a, b, fb
      b = lo + ratio * (hi - lo)
      fb = value(b)
    else:
      hi, b, fb = b, a, fa
      a = hi - ratio * (hi - lo)
      fa = value(a)
  return math.exp((lo + hi) / 2)


def young_interval(save_s: float, mtbf_s: float) -> float:
  """Young's ("A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974): sqrt(2 delta M)."""
  return math.sqrt(2 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
  """Daly's (2006) higher-order estimate: sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + delta / 18M] - delta for
  delta < 2M, else M."""
  if save_s >= 2 * mtbf_s:
    return mtbf_s
  return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(save_s / (2 * mtbf_s)) / 3 + save_s / (18 * mtbf_s)) - save_s


# The costs ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Costs:
  """delta, R and the step time on one machine, each with the words that say where it comes from."""

  save_s: float
  restart_s: float
  step_s: float | None  # None: not known (a record without it); the table then gives no step counts
  save_source: str
  restart_source: str
  step_source: str


def _seconds_list(costs: dict, key: str, path) -> list[float]:
  values = costs.get(key, [])
  if not isinstance(values, list) or not all(isinstance(v, (int, float)) and v >= 0 for v in values):
    raise config_lib.ConfigError(f"{path}: costs.{key} must be a list of seconds >= 0, not {values!r}; fix the record.")
  return [float(v) for v in values]


def measured_costs(record, path) -> Costs:
  """The costs a goodput record measured (`record`, read from `path`): delta the mean blocking save, R the mean
  restart (start to first finished step: init, restore and compile), the mean productive step. One ConfigError
  sentence, naming the file and what is missing, when it measured no save or no restart."""
  costs = record.get("costs") if isinstance(record, dict) else None
  if not isinstance(costs, dict):
    raise config_lib.ConfigError(
      f"{path} holds no measured costs (no 'costs' key: a record from an older sparsetx or another program); train "
      "in that workdir with this sparsetx, or leave out --costs_from to use the plan's estimates."
    )
  saves = _seconds_list(costs, "save_seconds", path)
  restarts = _seconds_list(costs, "restart_seconds", path)
  missing = [what for what, values in (("no save", saves), ("no restart", restarts)) if not values]
  if missing:
    raise config_lib.ConfigError(
      f"{path} measured {' and '.join(missing)} (costs.save_seconds and costs.restart_seconds need one each); train "
      "in that workdir until it saves, run it again to measure a restart, or leave out --costs_from."
    )
  if sum(saves) <= 0:
    raise config_lib.ConfigError(f"{path}: every measured save took 0 s; the save cost must be > 0 to size a cadence.")
  step = costs.get("step_seconds")
  step_s = float(step) if isinstance(step, (int, float)) and step > 0 else None

  def mean(values, what):
    return f"measured (mean of {len(values)} {what} in {path})"

  return Costs(
    save_s=sum(saves) / len(saves),
    restart_s=sum(restarts) / len(restarts),
    step_s=step_s,
    save_source=mean(saves, "blocking save calls"),
    restart_source=mean(restarts, "runs' start to first finished step"),
    step_source=f"measured (mean productive step in {path})" if step_s else f"not measured (none in {path})",
  )


def read_costs(path) -> Costs:
  """measured_costs of the goodput record at `path` (an epath.Path: local or gs://); a missing or unreadable file
  is one ConfigError sentence."""
  try:
    text = path.read_text()
  except FileNotFoundError:
    raise config_lib.ConfigError(
      f"--costs_from: {path} does not exist; give a workdir a training run wrote (its goodput record holds the "
      "measured costs), or leave out --costs_from to use the plan's estimates."
    ) from None
  except OSError as error:
    raise config_lib.ConfigError(f"--costs_from: {path} is unreadable ({error}); check the path.") from None
  try:
    record = json.loads(text)
  except ValueError as error:
    raise config_lib.ConfigError(f"{path} is not JSON ({error}); it is not a goodput record sparsetx wrote.") from None
  return measured_costs(record, path)


def machine(chip: str, chips: int) -> targets.Target:
  """The target of `chips` chips of a kind: GPUs in nodes of 8, TPUs in the fewest equal slices that fit."""
  if chip not in hardware.TARGET_CHIPS:
    raise config_lib.ConfigError(
      f"the save cadence sizes a run on {', '.join(hardware.TARGET_CHIPS)}, not {chip}; give --target=one of them."
    )
  per = hardware.CHIPS[chip].fast_domain
  if chip in ("h100", "h200"):
    if chips % per:
      raise config_lib.ConfigError(f"--chips={chips} is not whole nodes of {per} {chip}s; give a multiple of {per}.")
    return targets.parse(f"{chip}x{per}x{chips // per}")
  slices = next(n for n in range(1, chips + 1) if chips % n == 0 and chips // n <= per)
  cores = chips // slices * (2 if chip == "v5p" else 1)
  return targets.parse(f"{chip}-{cores}" + (f"x{slices}" if slices > 1 else ""))


def state_bytes_per_device(config, mesh_shape: dict) -> float:
  """Parameters and AdamW's two float32 moments on one device: what a checkpoint holds of it. Counted as
  plan/memory.planned_device_bytes counts them: the sparse tables and the vocabulary split over `expert`, the rest
  replicated (an upper bound where fsdp also splits them)."""
  model = config.model
  counts = ladder.param_counts(model)
  embeddings = model.vocab_size * model.d_model * (1 if model.tie_embeddings else 2)
  tables = counts["ffn_total"] if SPECS[model.ffn.type].units is not None else 0
  params = (embeddings + tables) / mesh_shape["expert"] + counts["total"] - embeddings - tables
  return params * (np.dtype(model.param_dtype).itemsize + 8)


def _mesh_on(config, target: targets.Target) -> tuple[dict, str]:
  """The mesh config.mesh builds on the target, or the target's own where config.mesh does not fit it."""
  try:
    return targets.mesh_shape(config.mesh, target), "config.mesh"
  except config_lib.ConfigError:
    spec = SPECS[config.model.ffn.type]
    units = config.model.ffn[spec.units.field] if spec.units is not None else None
    axes = targets.mesh_axes(target, units)
    shape = {axis: axes["ici"][axis] * axes["dcn"][axis] for axis in config_lib.MESH_AXES}
    return shape, f"{target.name}'s mesh (config.mesh does not fit it)"


def estimated_costs(config, chip: str, chips: int, compile_s: float | None = None) -> tuple[Costs, list[str]]:
  """(Costs, notes) from the plan, for `config` on `chips` chips of kind `chip`: delta the state's bytes per host
  copied to the host at HOST_COPY_BYTES_PER_S per chip; R = INIT_SECONDS + the restore (each host reading its
  bytes at its share of STORAGE_READ_BYTES_PER_S, at most its NICs' rate) + the compile (`compile_s` where the dry run
  measured one, else COMPILE_SECONDS); the step time step_cost's projection (compute and collectives overlapped)."""
  target = machine(chip, chips)
  mesh_shape, mesh_words = _mesh_on(config, target)
  sized = config.copy_and_resolve_references()  # whole rows on every device, as targets.apply sizes a config
  batch, microbatches = sized.data.global_batch_size, sized.train.microbatches
  sized.data.global_batch_size = -(-batch // chips) * chips
  sized.train.microbatches = targets.microbatches(
    sized.data.global_batch_size, sized.data.seq_len, target, targets.tokens_per_microbatch(target)
  )
  step_s = step_cost.project_step(sized, mesh_shape, target.chip).step_overlap_s
  per_device = state_bytes_per_device(config, mesh_shape)
  per_host = per_device * target.per_host
  hosts = chips // target.per_host
  nics, share = target.chip.dcn_bandwidth * target.per_host, STORAGE_READ_BYTES_PER_S / hosts
  read_rate = min(nics, share)
  read_words = f"its share of 2 TB/s of storage over {hosts:,} hosts" if share <= nics else "its NICs' line rate"
  restore_s = per_host / read_rate
  compile_s, compile_words = (
    (compile_s, f"compile {compile_s:.0f} s, measured by this dry run on its simulated devices")
    if compile_s is not None
    else (COMPILE_SECONDS, f"compile {COMPILE_SECONDS:.0f} s, assumed")
  )
  shape = " x ".join(f"{axis}={size}" for axis, size in mesh_shape.items() if size > 1)
  notes = [f"{target.name} ({shape}; {mesh_words}), {target.per_host} chips per host"]
  if (sized.data.global_batch_size, sized.train.microbatches) != (batch, microbatches):
    notes.append(
      f"the step sized as targets.apply sizes it: global batch {batch:,} -> {sized.data.global_batch_size:,} "
      f"sequences, {microbatches} -> {sized.train.microbatches} micro-batches"
    )
  return Costs(
    save_s=per_device / HOST_COPY_BYTES_PER_S,
    restart_s=INIT_SECONDS + restore_s + compile_s,
    step_s=step_s,
    save_source=f"estimated ({per_device / 1e9:.3g} GB of parameters and AdamW moments per device, copied to the "
    f"host at {HOST_COPY_BYTES_PER_S / 1e9:.0f} GB/s: PCIe 5.0 x16)",
    restart_source=f"estimated (init {INIT_SECONDS:.0f} s, assumed; restore {_seconds(restore_s)}: "
    f"{per_host / 1e9:.3g} GB per host at {read_rate / 1e9:.3g} GB/s, {read_words}; {compile_words})",
    step_source=f"estimated (plan/step_cost.py's projection on {target.chip.name}, compute and collectives overlapped)",
  ), notes


# The table ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
  """One chip count's column of the table (seconds)."""

  chips: int
  mtbf_s: float
  costs: Costs
  notes: tuple
  by_time_s: float | None  # config.checkpoint.every_minutes (None: 0, off)
  by_steps_s: float | None  # config.checkpoint.every steps at the step time (None: no step time)
  optimal_s: float
  daly_s: float
  young_s: float

  def goodput(self, tau: float | None) -> float | None:
    return None if tau is None else float(goodput(tau, self.costs.save_s, self.costs.restart_s, self.mtbf_s))

  @property
  def configured_s(self) -> float | None:
    """The interval the trainer runs: the sooner of the two (a save of either kind restarts the save clock)."""
    return min((s for s in (self.by_time_s, self.by_steps_s) if s is not None), default=None)


def cadence_row(config, chips: int, chip_mtbf_hours: float, costs: Costs, notes=()) -> Row:
  """The table's column for `chips` chips with the given costs. The trainer's save clock restarts after each save's
  blocking part, so every_minutes is tau, the work between saves."""
  mtbf_s = system_mtbf_seconds(chips, chip_mtbf_hours)
  checkpoint = config.checkpoint
  return Row(
    chips=chips,
    mtbf_s=mtbf_s,
    costs=costs,
    notes=tuple(notes),
    by_time_s=60.0 * checkpoint.get("every_minutes", 0.0) or None,
    by_steps_s=checkpoint.every * costs.step_s if costs.step_s else None,
    optimal_s=optimal_interval(costs.save_s, costs.restart_s, mtbf_s),
    daly_s=daly_interval(costs.save_s, mtbf_s),
    young_s=young_interval(costs.save_s, mtbf_s),
  )


def _configured_words(row: Row, checkpoint) -> str:
  if row.by_steps_s is None:
    return "checkpoint.every's steps not converted (no step time)"
  if row.configured_s == row.by_steps_s:
    return f"checkpoint.every={checkpoint.every} steps saves first: the interval the run keeps"
  return "every_minutes saves first: the interval the run keeps"


def _seconds(s: float) -> str:
  if s >= 7200:
    return f"{s / 3600:.1f} h"
  return f"{s:.1f} s" if s >= 10 else f"{s:.2f} s" if s >= 1 else f"{s * 1000:.3g} ms"


def _minutes(s: float | None) -> str:
  return "-" if s is None else f"{s / 60:.2f} min"


def _percent(g: float | None) -> str:
  return "-" if g is None else f"{g:.3%}"


def format_table(rows: list[Row], chip_mtbf_hours: float, checkpoint) -> str:
  """The dry run's save-cadence table (`checkpoint`: config.checkpoint): a column per chip count, then where each
  figure comes from."""
  width = 16
  lines = [
    "save cadence (Daly 2006: failures at random; goodput = work / wall time, restarts included; README, "
    "'How often to save'):",
    f"  {'':<36}" + "".join(f"{f'{row.chips:,} chips':>{width}}" for row in rows),
  ]

  def line(label, values):
    lines.append(f"  {label:<36}" + "".join(f"{v:>{width}}" for v in values))

  line("system MTBF M", [_seconds(row.mtbf_s) for row in rows])
  line("blocking save delta", [_seconds(row.costs.save_s) for row in rows])
  line("restart R (init, restore, compile)", [_seconds(row.costs.restart_s) for row in rows])
  line("step time", ["-" if row.costs.step_s is None else _seconds(row.costs.step_s) for row in rows])
  line(f"configured every_minutes={checkpoint.get('every_minutes', 0.0):g}", [_minutes(r.by_time_s) for r in rows])
  line("  its goodput", [_percent(row.goodput(row.by_time_s)) for row in rows])
  line(f"configured every={checkpoint.every} steps", [_minutes(row.by_steps_s) for row in rows])
  line("  its goodput", [_percent(row.goodput(row.by_steps_s)) for row in rows])
  line("optimal every_minutes (numeric)", [_minutes(row.optimal_s) for row in rows])
  line(
    "  in steps",
    ["-" if row.costs.step_s is None else f"{round(row.optimal_s / row.costs.step_s):,}" for row in rows],
  )
  line("  its goodput", [_percent(row.goodput(row.optimal_s)) for row in rows])
  line("Daly's closed form", [_minutes(row.daly_s) for row in rows])
  line("Young's sqrt(2 delta M)", [_minutes(row.young_s) for row in rows])
  lines.append(
    f"  M: {chip_mtbf_hours:,.0f} h per chip / chips ("
    + (
      "Llama 3 report, section 3.3.4: 419 unexpected interruptions in 54 days on 16,384 H100s"
      if chip_mtbf_hours == LLAMA3_CHIP_MTBF_HOURS
      else "--chip_mtbf_hours"
    )
    + ")"
  )
  sources = (
    ("configured", lambda row: _configured_words(row, checkpoint)),
    ("save delta", lambda row: row.costs.save_source),
    ("restart R", lambda row: row.costs.restart_source),
    ("step time", lambda row: row.costs.step_source),
    ("machine", lambda row: "; ".join(row.notes)),
  )
  for what, words_of in sources:  # once where every column shares the words, else per chip count
    words = [words_of(row) for row in rows]
    if len(set(words)) == 1:
      lines += [f"  {what}: {words[0]}"] if words[0] else []
    else:
      lines += [f"  {what} at {row.chips:,} chips: {w}" for row, w in zip(rows, words)]
  if any(row.costs.save_source.startswith("measured") for row in rows):
    lines.append(
      "  measured figures are the recorded run's own (its model, its machine, its storage); a tiny run's stand for a"
      " small model, not for this config on these chips"
    )
  lines.append(
    "  to save at the optimum: set config.checkpoint.every_minutes to it and checkpoint.every above its steps (a save"
    " by step count comes first otherwise)"
  )
  return "\n".join(lines)

"""Which implementation runs each kernel op: the selection shared by the ops, above their packages.

An op is the sparse layers' row kernels (`rows`: row_dots, row_accumulate, segment_sums and the forms over them,
rows/interface.py) or MoE's grouped matmul (`grouped_matmul`). Each op's package lists its implementations once
(rows/table.py, grouped_matmul/table.py), in the order Mosaic GPU, Triton, Pallas TPU, XLA; one that cannot take a
call raises NotImplementedError with its reason and the next is tried. `auto` tries them in the order the device
measured (kernels/autotune_table.py, filled by sparsetx-autotune), else in DEFAULT_ORDER. A new implementation is
its file and one line in its op's table.

More: docs/modules.md, sparsetx/kernels/registry.py.
"""

import contextlib

from absl import logging

from sparsetx import config
from sparsetx.kernels import autotune_table
from sparsetx.kernels.device import TracedDevice, target
from sparsetx.kernels.grouped_matmul.table import GROUPED
from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows.interface import RowKernels
from sparsetx.kernels.rows.table import ROWS

OPS = {"rows": ROWS, "grouped_matmul": GROUPED}
NAMES = tuple(dict.fromkeys(i.name for op in OPS.values() for i in op))  # what kernel.implementation may name

# Without a measured table (a dry run for a topology, a device not yet tuned): the Triton row kernels before Mosaic
# GPU's, whose segment_sums stopped with an illegal instruction on an H200 under jax 0.11.2 and have not run
# correctly on a GPU since; MoE's grouped matmul on Mosaic GPU first, which matched ragged_dot on an H200. An
# implementation not listed comes after these: a new design runs where the device measured it fastest.
DEFAULT_ORDER = {"rows": ("triton", "mosaic", "tpu", "xla"), "grouped_matmul": ("mosaic", "triton", "tpu", "xla")}

_warned = set()  # the warnings already given in this process
_recorded = None  # the calls resolved while `recording` is active: {(op, shape class): example shapes}


def by_name(op: str, name: str):
  """The implementation of `op` called `name`; `name@knob=value,...` is it at that tiling (rows/records.py)."""
  name, _, tiling = name.partition("@")
  for implementation in OPS[op]:
    if implementation.name == name:
      return at_tiling(op, implementation, tiling) if tiling else implementation
  raise ValueError(f"{op} has no implementation {name!r}; it has {[i.name for i in OPS[op]]}.")


def at_tiling(op: str, implementation, tiling: str):
  """`implementation` at a tiling written `knob=value,...` (the autotune table's spelling)."""
  if op != "rows":
    raise ValueError(f"only the row kernels take a tiling, not {op}.")
  try:
    knobs = {knob: int(value) for knob, _, value in (part.partition("=") for part in tiling.split(","))}
  except ValueError:
    raise ValueError(f"tiling {tiling!r} is not knob=integer,...; e.g. block_tokens=16,block_d=256.") from None
  return implementation.at_tiling(knobs)


def tiling_spec(implementation, tiling: dict) -> str:
  return implementation.at_tiling(tiling).name


def runs_here(op: str, interpreted: bool = False) -> list:
  """What the target device runs of `op`, the one list the autotuner, the kernel bench and the acceptance check
  take: the implementations native to its platform that take it, XLA's designs included. With `interpreted`, also
  the kernel families that run in interpret mode off their platform without being named (Triton's: a CPU's check
  of them); another family's interpreter runs only where a caller names it (by_name)."""
  device, found = target(), []
  for implementation in OPS[op]:
    off_platform = implementation.platform not in (None, device.platform)
    if off_platform and not (interpreted and implementation.interprets_by_default):
      continue
    try:
      implementation.refuse(device, naming(implementation, KernelOptions()), None)
    except NotImplementedError:
      continue
    found.append(implementation)
  return found


def for_op(op: str, name: str):
  """`op`'s implementation of a name kernel.implementation gives: its own, else its family's (a row-kernel design,
  triton_row_order, names Triton's grouped matmul; xla_row_order XLA's)."""
  found = {i.name: i for i in OPS[op]}
  base = name.partition("@")[0]
  if base in found:
    return by_name(op, name)
  family = base.partition("_")[0]
  if base in NAMES and family in found:
    return found[family]
  raise ValueError(
    f"kernel implementation={name!r} is unknown; use auto, reference, one of {', '.join(NAMES)}, or a list 'a,b'."
  )


def check_config(kernel, field: str = "config.model.ffn.kernel.implementation") -> None:
  """Raises ConfigError naming the field where kernel.implementation names what the registry lacks (config checks
  the value's form; the names are the registry's)."""
  implementation = kernel.get("implementation", "auto")
  if implementation in config.KERNEL_CHOICES:
    return
  for name in config.implementation_names(implementation):
    try:
      for_op("rows", name)
    except ValueError as error:
      raise config.ConfigError(f"{field}: {error}") from None


def candidates(op: str, options: KernelOptions, device: TracedDevice) -> list:
  """The implementations `options.implementation` allows for `device`, in the order they are tried: `auto` every
  implementation (a CPU: XLA's), in DEFAULT_ORDER; one name that implementation, wherever it is (off its platform in
  interpret mode); a list its entries in order, each only on its own platform (a CPU with none of its own: XLA)."""
  xla = by_name(op, "xla")
  chosen = options.implementation
  if chosen in ("xla", "reference") or (chosen == "auto" and device.platform == "cpu"):
    return [xla]
  if chosen == "auto":
    order = list(DEFAULT_ORDER[op])
    return sorted(OPS[op], key=lambda i: order.index(i.name) if i.name in order else len(order))
  names = config.implementation_names(chosen)
  listed = list({id(i): i for i in (for_op(op, name) for name in names)}.values())
  if len(names) == 1:
    return listed
  native = [i for i in listed if i.platform in (None, device.platform)]
  return native or ([xla] if device.platform == "cpu" else listed)


def naming(implementation, base: KernelOptions) -> KernelOptions:
  """The options that ask for `implementation` by name (its config knobs taken from `base`; a tiling's come from
  the implementation itself)."""
  return base._replace(implementation=implementation.name.partition("@")[0])


def resolve(op: str, options: KernelOptions, key: str, call=None):
  """The first implementation of `op` that takes this call (`call`: its operands where a refusal reads them);
  under `auto`, a measured table's ranking for this device and `key` goes first and what it dropped is refused."""
  device = target()
  tried = candidates(op, options, device)
  measured = miss = None
  if options.implementation == "auto" and device.platform != "cpu" and not autotune_table.is_off():
    measured = autotune_table.lookup(device.device_kind, op, key, options, nearest=True)
    if measured is None:
      miss = f"has no entry in {autotune_table.source()} (sparsetx-autotune measures it)"
    elif not measured.usable:  # nothing ran, or XLA itself failed: the default order
      miss = f"has no usable ranking ({measured.dropped}; sparsetx-autotune --again measures it anew)"
      measured = None
  if measured is not None:  # a tiling the device ranked goes in before its implementation's config tiling
    offered = {i.name for i in tried}
    tried += [by_name(op, spec) for spec in measured.ranking if "@" in spec and spec.partition("@")[0] in offered]
    rank = {name: n for n, name in enumerate(measured.ranking)}
    tried.sort(key=lambda i: rank.get(i.name, len(rank)))
  if _recorded is not None:
    _recorded.setdefault((op, key), call)
  reasons = []
  for implementation in tried:
    try:
      if measured is not None and implementation.name in measured.dropped:
        raise NotImplementedError(f"dropped by the measured table: {measured.dropped[implementation.name]}")
      implementation.refuse(device, options, call)
      if miss is not None:  # once per call in a process (the line names it): what runs instead of a measured choice
        _warn_once(
          f"autotune: {op} {key} on {device.device_kind} {miss}; auto runs {implementation.name}, the first of "
          f"the default order {DEFAULT_ORDER[op]} that takes it"
        )
      return implementation
    except NotImplementedError as why:
      reasons.append(f"{implementation.name}: {why}")
  raise NotImplementedError(f"no {op} implementation takes this call on {device.device_kind}: {'; '.join(reasons)}")


def _warn_once(line: str) -> None:
  if line not in _warned:
    _warned.add(line)
    logging.warning(line)


def rows(options: KernelOptions, key: str, call=None) -> RowKernels:
  """The row kernels of one layer call (`key`: its shape_class; `call`: its sizes, what the autotuner measures)."""
  return resolve("rows", options, key, call)


@contextlib.contextmanager
def recording():
  """Yields {(op, shape class): the call's operands or None} of every op resolved inside (a step being traced)."""
  global _recorded
  outer, _recorded = _recorded, {}
  try:
    yield _recorded
  finally:
    _recorded = outer


__all__ = ["KernelOptions", "by_name", "candidates", "recording", "resolve", "rows"]

"""Named machines a config is sized for: `h100x8`, `h200x8`, `h100x8x4`, `v5p-64`, `v5p-64x2`, `v6e-256`.

  h100xG[xN], h200xG[xN]  N nodes (default 1) of G GPUs (8: an HGX/DGX node; 4: an HGX 4-GPU board); NVLink inside
                          a node, the data-center network (DCN) between nodes
  v5p-C[xN], v6e-C[xN]    N slices (default 1) named as Cloud TPU names them: v5p-C counts TensorCores, two per
                          chip (v5p-64 = 32 chips); v6e-C counts chips (v6e-256 = 256 chips); ICI inside a slice

A target gives the mesh: the sparse layers' units (channels, trees, experts) split over `expert` inside one node or
slice (the largest divisor of the units that divides the node: the token movement stays on NVLink/ICI), `data`
over the rest of the node and over the nodes (DCN). configs/ladder.py and configs/large.py read it.
"""

import dataclasses
import math
import re

from sparsetx import config as config_lib
from sparsetx import hardware

_GPU_RE = re.compile(r"^(h100|h200)x(\d+)(?:x(\d+))?$")
_TPU_RE = re.compile(r"^(v5p|v6e)-(\d+)(?:x(\d+))?$")
_CORES_PER_CHIP = {"v5p": 2, "v6e": 1}  # what the number in a Cloud TPU name counts
EXAMPLES = "h100x8, h200x8, h100x8x4 (4 nodes), v5p-64 (32 chips), v5p-64x2 (2 slices), v6e-256"


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  chip: hardware.Chip
  per_granule: int  # chips in one node / slice (NVLink / ICI)
  granules: int  # nodes / slices (joined by DCN)

  @property
  def devices(self) -> int:
    return self.per_granule * self.granules

  @property
  def per_host(self) -> int:
    """Chips one host feeds: a GPU node's; a Cloud TPU VM's 4 (a v6e slice of up to 8 chips is one host)."""
    if self.name.startswith(("h100", "h200")):
      return self.per_granule
    return (
      self.per_granule if self.chip is hardware.CHIPS["v6e"] and self.per_granule <= 8 else min(4, self.per_granule)
    )


def parse(name: str) -> Target:
  """The Target a name gives; a ConfigError naming the forms otherwise."""
  gpu, tpu = _GPU_RE.match(name), _TPU_RE.match(name)
  if gpu:
    chip, per_granule, granules = gpu[1], int(gpu[2]), int(gpu[3] or 1)
    fits = 1 <= per_granule <= hardware.CHIPS[chip].fast_domain
  elif tpu:
    chip, cores, granules = tpu[1], int(tpu[2]), int(tpu[3] or 1)
    per_granule = cores // _CORES_PER_CHIP[chip]
    fits = cores % _CORES_PER_CHIP[chip] == 0 and 1 <= per_granule <= hardware.CHIPS[chip].fast_domain
  else:
    chip, fits = None, False
  if not fits or granules < 1:
    raise config_lib.ConfigError(f"target {name!r} is not a machine this knows; use one of {EXAMPLES}.")
  return Target(name, hardware.CHIPS[chip], per_granule, granules)


def expert_size(target: Target, units: int | None) -> int:
  """The `expert` axis inside a node: the largest size dividing both the node's chips and the units (the node's
  chips when the layer has none to split: its `expert` axis then only splits the batch and the vocabulary)."""
  return target.per_granule if units is None else math.gcd(target.per_granule, units)


def mesh_axes(target: Target, units: int | None) -> dict:
  """config.mesh's ici and dcn for the target: `expert` inside a node, `data` over the rest and over the nodes."""
  expert = expert_size(target, units)
  return dict(
    ici=dict(data=target.per_granule // expert, fsdp=1, tensor=1, expert=expert),
    dcn=dict(data=target.granules, fsdp=1, tensor=1, expert=1),
  )


def mesh_shape(mesh_config, target: Target) -> dict:
  """{axis: size} of config.mesh on the target's devices (each axis's ici size times its dcn size, a -1 resolved as
  mesh.make_mesh resolves it): the mesh a run there builds, known without its devices."""
  from sparsetx.parallel import mesh as mesh_lib  # jax and flax: only for this

  ici = mesh_lib.axis_sizes(dict(mesh_config.ici), target.per_granule, "ici")
  dcn = mesh_lib.axis_sizes(dict(mesh_config.dcn), target.granules, "dcn")
  return {axis: i * d for axis, i, d in zip(config_lib.MESH_AXES, ici, dcn)}


def microbatches(global_batch: int, seq_len: int, target: Target, tokens: int) -> int:
  """The fewest micro-batches that leave at most `tokens` tokens per device at a time (at least one row), each
  micro-batch's rows still dividing over every device."""
  rows = global_batch // target.devices
  if rows < 1 or global_batch % target.devices:
    raise config_lib.ConfigError(
      f"config.data.global_batch_size={global_batch} does not split over the {target.devices} devices of "
      f"{target.name}; use a multiple of {target.devices}."
    )
  return next(m for m in range(1, rows + 1) if rows % m == 0 and (rows // m) * seq_len <= max(tokens, seq_len))


def tokens_per_microbatch(target: Target) -> int:
  """Tokens per device at a time: 8,192 on an 80 GB chip (the LM head's float32 logits, softmax and cotangent
  are then 4.9 GB at a 50,304 vocabulary), scaled with the chip's HBM to the nearest power of two."""
  return 2 ** round(math.log2(8192 * target.chip.hbm_bytes / (80 * hardware.GIGA)))


def vocab_split_rules(rules) -> tuple:
  """`rules` with the vocabulary split over tensor x expert: the embedding and LM head are then not replicated on
  an expert-parallel mesh (the logits' batch takes `expert` first, so activations are unchanged)."""
  return tuple(("vocab", ("tensor", "expert")) if name == "vocab" else (name, axes) for name, axes in rules)


_V5P_TORUS = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "4x4x2", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8", 512: "8x8x8"}
_V6E_GRID = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_GPU_FILES = {"h100": "h100", "h200": "h200"}


def topology_name(name: str) -> str:
  """The topology (parallel/topology.py) of a target's machine, for compiling its programs here: one slice of a
  TPU pod (`v5p-64` -> `v5p:4x4x2`), or the nodes of GPUs (`h100x8x4` -> `h100:1x4x8`)."""
  target = parse(name)
  chip = name.split("-")[0].split("x")[0]
  if chip in _GPU_FILES:
    return f"{_GPU_FILES[chip]}:1x{target.granules}x{target.per_granule}"
  shapes = _V5P_TORUS if chip == "v5p" else _V6E_GRID
  if target.granules > 1 or target.per_granule not in shapes:
    raise config_lib.ConfigError(
      f"target {name!r} has no single-slice topology to compile for; compile one slice with --topology "
      f"({chip}:{next(iter(shapes.values()))}, ...)."
    )
  return f"{chip}:{shapes[target.per_granule]}"


def size_replication_limit(config, chip) -> None:
  """config.mesh.max_replicated_mib raised to 1/512 of the chip's HBM (a target's or a topology's chip), in place."""
  config.mesh.max_replicated_mib = max(config.mesh.max_replicated_mib, chip.hbm_bytes / 512 / 2**20)


def apply(config, name: str, units: int | None):
  """config sized for the target `name` in place (mesh, rules, batch, micro-batches, replication limit); returns it.

  `units`: the sparse layer's count of what `expert` splits (config.model.ffn's channels, trees or experts), None
  for a dense layer. A parameter may stay replicated up to 1/512 of the chip's HBM (config.mesh.max_replicated_mib:
  160 MB on an H100; the FFF rungs whose tree count leaves `expert` at 2 replicate half the embedding)."""
  target = parse(name)
  for field in ("global_batch_size", "eval_batch_size"):  # whole rows on every device (v6e-256: 256 rows, not 128)
    config.data[field] = -(-config.data[field] // target.devices) * target.devices
  config.mesh.target = name
  config.mesh.update(mesh_axes(target, units))
  config.mesh.rules = vocab_split_rules(config.mesh.rules)
  size_replication_limit(config, target.chip)
  config.train.microbatches = microbatches(
    config.data.global_batch_size, config.data.seq_len, target, tokens_per_microbatch(target)
  )
  return config

"""The device mesh and the shardings derived from logical axis names.

Mesh axes are `data`, `fsdp`, `tensor`, `expert`; each has a size within a slice (ICI) and across
slices (DCN), with one -1 per group inferred from the device count. Parameters carry logical axis
names (`nn.with_logical_partitioning`); `config.mesh.rules` maps them to mesh axes.
"""

import math

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sparsetx.config import MESH_AXES, ConfigError
from sparsetx.parallel import per_device


def axis_sizes(sizes: dict, total: int, group: str) -> list[int]:
  """Resolves the -1 of one group so the product is `total`; refuses sizes that don't divide it."""
  known = math.prod(sizes[a] for a in MESH_AXES if sizes[a] != -1)
  inferred = [a for a in MESH_AXES if sizes[a] == -1]
  if total % known or (not inferred and known != total):
    shape = ", ".join(f"{a}={sizes[a]}" for a in MESH_AXES)
    raise ConfigError(
      f"config.mesh.{group} ({shape}) does not divide {total} devices; make the product of its axes {total} "
      "(or set one axis to -1)."
    )
  return [total // known if sizes[a] == -1 else sizes[a] for a in MESH_AXES]


def make_mesh(mesh_config: ml_collections.ConfigDict, devices=None, granules: int | None = None) -> Mesh:
  """The mesh of config.mesh over `devices` (default: all). `granules` simulates that many nodes / slices on one
  process's devices (the dry run's CPU devices): consecutive runs of the devices are the granules, laid out as
  create_hybrid_device_mesh lays out real ones (see granule_of)."""
  devices = list(devices if devices is not None else jax.devices())
  dcn = axis_sizes(dict(mesh_config.dcn), granules or _slice_count(devices), "dcn")
  n_slices = math.prod(dcn)
  ici = axis_sizes(dict(mesh_config.ici), len(devices) // n_slices, "ici")
  if granules:
    per = len(devices) // granules
    meshes = [mesh_utils.create_device_mesh(ici, devices[g * per : (g + 1) * per]) for g in range(granules)]
    blocks = np.empty(granules, dtype=object)
    blocks[:] = meshes
    array = np.block(blocks.reshape(dcn).tolist())
  elif n_slices > 1:
    granule_is_process = devices[0].platform != "tpu"
    array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=granule_is_process)
  else:
    array = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
  return Mesh(array, MESH_AXES)


def granule_of(devices, granules: int | None = None) -> dict:
  """Device id -> its node / slice: `granules` consecutive runs of `devices` (simulated, as make_mesh's), else
  the slice (TPU) or process (hosts of a multi-node GPU job)."""
  if granules:
    per = len(devices) // granules
    return {d.id: i // per for i, d in enumerate(devices)}
  return {d.id: _granule(d) for d in devices}


def _granule(device) -> int:
  """A TPU chip's slice (the hosts of one slice share its ICI: a topology's chips carry no slice index and are
  one slice); a GPU's or CPU's process (the hosts of a multi-node GPU job are joined by the DCN)."""
  if device.platform == "tpu":
    return getattr(device, "slice_index", 0)
  return device.process_index


def _slice_count(devices) -> int:
  return len({_granule(d) for d in devices})


def logical_sharding(logical_specs, mesh: Mesh, rules) -> object:
  """NamedShardings for a tree of logical PartitionSpecs (as from nn.get_partition_spec)."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, tuple(rules))


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
  """How a [batch, length] input is laid out: its rows split over the mesh axes of `batch`."""
  return NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", "length"), tuple(rules)))


def batch_axes(mesh: Mesh, rules) -> tuple:
  """The mesh axes a batch's rows are split over."""
  return per_device.axis_tuple(batch_sharding(mesh, rules).spec[0])


def check_not_replicated(shardings, abstract, mesh: Mesh, max_mib: float) -> None:
  """Refuses a large parameter that every device would hold in full on a multi-device mesh."""
  if mesh.size == 1:
    return
  for (path, sharding), leaf in zip(jax.tree.leaves_with_path(shardings), jax.tree.leaves(abstract)):
    mib = np.prod(leaf.shape) * leaf.dtype.itemsize / 2**20
    if sharding.is_fully_replicated and mib > max_mib:
      raise ConfigError(
        f"parameter {jax.tree_util.keystr(path)} ({mib:.0f} MiB) would be fully replicated on all {mesh.size} "
        "devices; map one of its logical axes to a mesh axis of size > 1 in config.mesh.rules (e.g. fsdp or "
        "expert), or raise config.mesh.max_replicated_mib."
      )


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())

"""Ladder rungs on named machines (configs/ladder.py:FFN,SCALE,TARGET; sparsetx/plan/targets.py): the mesh,
rules and micro-batches a target gives, a compile of each representative rung on its target's mesh (simulated CPU
devices), and the device memory it projects against the chip's HBM (plan/memory.device_memory)."""

import time

import jax
import pytest
from conftest import load_config

from sparsetx import config as config_lib
from sparsetx import hardware
from sparsetx.measure import aot
from sparsetx.models import ladder
from sparsetx.models.ffn import placement
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.perf import hlo_text, roofline
from sparsetx.plan import memory, targets
from sparsetx.train import state as state_lib

TARGETS = ("h100x8", "h200x8", "h100x8x4", "v5p-64")


def test_target_names_give_their_machines():
  assert targets.parse("h100x8") == targets.Target("h100x8", hardware.CHIPS["h100"], 8, 1)
  assert targets.parse("h100x8x4").devices == 32 and targets.parse("h100x8x4").granules == 4
  assert targets.parse("v5p-64").per_granule == 32  # a v5p name counts TensorCores, two per chip
  assert targets.parse("v5p-64x2").devices == 64 and targets.parse("v6e-256").per_granule == 256
  for bad in ("h100x16", "v5p-63", "a100x8", "h100x8x0", "v6e-512"):
    with pytest.raises(config_lib.ConfigError, match="is not a machine this knows; use one of h100x8"):
      targets.parse(bad)


@pytest.mark.parametrize("target", TARGETS)
def test_every_rung_is_sized_for_the_target(target):
  """Every ladder rung: the mesh fills the target with `expert` inside one node and dividing the units, the paper's
  128 x 2,048 tokens per step, at most the chip's token budget per device at a time, and a planned memory
  within the chip's HBM."""
  machine = targets.parse(target)
  budget = targets.tokens_per_microbatch(machine)
  for ffn_type in config_lib.FFN_TYPES:
    for scale in ladder.SCALES:
      config = config_lib.validate(load_config("configs/ladder.py", f"{ffn_type},{scale},{target}"))
      ici, dcn = config.mesh.ici, config.mesh.dcn
      assert ici.data * ici.expert == machine.per_granule and dcn.data == machine.granules
      assert (ici.fsdp, ici.tensor, dcn.expert) == (1, 1, 1)
      assert config.data.global_batch_size * config.data.seq_len == 128 * 2048
      rows = config.data.global_batch_size // config.train.microbatches // machine.devices
      assert rows >= 1 and rows * config.data.seq_len <= budget
      shape = (ici.data * dcn.data, 1, 1, ici.expert)
      placement.check_units_divide(config, jax.sharding.AbstractMesh(shape, config_lib.MESH_AXES))
      planned = memory.planned_device_bytes(config, machine.devices, ici.expert)
      assert planned <= machine.chip.hbm_bytes, (ffn_type, scale)
      plain = config.copy_and_resolve_references()
      plain.model.remat = "none"
      no_remat = memory.planned_device_bytes(plain, machine.devices, ici.expert)
      assert (config.model.remat == "none") == (no_remat <= machine.chip.hbm_bytes / 2)  # `full` only when needed


def test_the_fff_rung_with_the_fewest_shards_passes_the_replication_check():
  """fff scale 7 has 18 trees, so `expert` is 2 on 8 GPUs: half the vocabulary per device, within the target's
  replication limit (1/512 of the HBM); nothing else large is replicated."""
  config = config_lib.validate(load_config("configs/ladder.py", "fff,7,h100x8"))
  assert config.mesh.ici.expert == 2
  aot.abstract_state(config, jax.sharding.AbstractMesh((4, 1, 1, 2), config_lib.MESH_AXES))


# (rung, simulated nodes): each compiles on its target's full mesh (8 simulated devices: an 8-GPU node, a v5p-16
# slice of 8 chips, and 2 nodes of 4 GPUs for the DCN) at a shrunk shape: 8 rows of 128 tokens, one micro-batch.
REPRESENTATIVE = ["sgatlin,5,h100x8", "fff,2,h100x8", "mlp,8,h200x8", "sgatlin,2,v5p-16", "moe,2,h100x4x2"]


@pytest.mark.parametrize("arg", REPRESENTATIVE)
def test_rung_compiles_on_its_target_and_fits_the_chip(arg):
  start = time.time()
  full = config_lib.validate(load_config("configs/ladder.py", arg))
  machine = targets.parse(arg.split(",")[2])
  config = full.copy_and_resolve_references()
  config.data.update(seq_len=128, global_batch_size=8, eval_batch_size=8)
  config.train.microbatches = 1
  granules = aot.dcn_granule_count(config)
  devices = jax.devices()[: machine.devices]
  mesh = state_lib.checked_mesh(config, devices, granules)
  assert dict(mesh.shape) == dict(
    data=config.mesh.ici.data * config.mesh.dcn.data, fsdp=1, tensor=1, expert=config.mesh.ici.expert
  )
  report = aot.dry_run(config, mesh, mesh_lib.granule_of(devices, granules))
  shrunk = memory.device_memory(config, mesh, report)
  assert shrunk.compiled <= machine.chip.hbm_bytes and shrunk.device <= shrunk.compiled
  # the paper shape's device memory: the compiled state (parameters, optimizer; the batch is a few KiB) with the
  # paper shape's activations
  paper = memory.device_memory(full, mesh, report)
  assert paper.tokens == 128 * 2048 // full.train.microbatches // machine.devices
  assert shrunk.state < paper.device <= machine.chip.hbm_bytes
  crossing = [c for c in report.collectives if c.granules > 1]
  if machine.granules > 1:  # expert inside a node: the token movement stays there, data's reductions cross the DCN
    expert_group = [c for c in report.collectives if c.group == config.mesh.ici.expert or c.op == "all-to-all"]
    assert expert_group and all(c.granules == 1 for c in expert_group)
    assert crossing and {c.op for c in crossing} <= {"all-reduce", "reduce-scatter", "all-gather"}
    assert all(c.group % machine.granules == 0 for c in crossing)
    sent = sum(roofline.dcn_bytes(c.op, c.nbytes, c.group, c.granules) for c in crossing)
    assert "over the DCN: " in aot.format_report(report) and sent > 0
  else:
    assert not crossing
  print(f"{arg}: {time.time() - start:.0f} s")


def test_simulated_nodes_are_consecutive_devices_on_the_outer_axis():
  config = config_lib.validate(load_config("configs/ladder.py", "moe,2,h100x4x2"))
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices(), granules=2)
  ids = [[d.id for d in row.flat] for row in mesh.devices]  # data (the DCN) outermost
  assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]
  granule = hlo_text.dcn_granules(mesh, mesh_lib.granule_of(jax.devices(), 2))
  assert [granule[i] for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_replica_groups_in_each_printed_form():
  """The forms XLA prints (mesh with and without device ids, iota, explicit, permute pairs) give the same groups
  as the arange/transpose they stand for."""
  assert hlo_text.replica_groups("all-reduce(%a), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use") == [
    [0, 1, 2, 3],
    [4, 5, 6, 7],
  ]
  line = "all-gather(%g), replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, dims"
  assert hlo_text.replica_groups(line) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert hlo_text.replica_groups("all-reduce(%g), replica_groups=[2,4]<=[4,2]T(1,0), use") == [
    [0, 2, 4, 6],
    [1, 3, 5, 7],
  ]
  assert hlo_text.replica_groups("all-reduce(%g), replica_groups={{0,1},{2,3}}, use") == [[0, 1], [2, 3]]
  assert hlo_text.replica_groups("collective-permute(%g), source_target_pairs={{0,4},{1,5}}, m") == [[0, 4], [1, 5]]


def test_a_collective_across_nodes_is_priced_hierarchically():
  """An all-reduce of S bytes over 2 nodes of 4 H100s: a ring of 4 on NVLink (2 S 3/4 at 450 GB/s) plus S/4 over
  each GPU's 50 GB/s NIC (2 S/4 x 1/2)."""
  chip, S = hardware.CHIPS["h100"], 1e9
  assert roofline.dcn_bytes("all-reduce", S, 8, 2) == pytest.approx(S / 4)
  expected = 2 * S * 3 / 4 / 450e9 + S / 4 / 50e9
  assert roofline.collective_seconds("all-reduce", S, 8, chip, granules=2) == pytest.approx(expected)
  assert roofline.dcn_bytes("all-gather", S, 8, 1) == 0.0


def test_one_chip_table_serves_the_targets_and_the_training_loops_mfu():
  """Every device kind the trainer reports MFU for is in hardware.py's table (the datasheet figures), and only
  the chips whose interconnect the table holds are sizable targets."""
  from sparsetx import hardware

  kinds = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
  }
  assert {kind: hardware.chip_of(kind).peak_flops for kind in kinds} == kinds
  assert hardware.chip_of("cpu") is None
  assert all(chip.fast_domain for chip in hardware.chips("all"))
  with pytest.raises(ValueError, match="not a known chip"):
    hardware.chips("a100")

"""Projected step time (sparsetx/perf/roofline.py) against hand-computed roofline figures."""

import pytest

from sparsetx import hardware
from sparsetx.measure import aot
from sparsetx.perf import hlo_text, roofline

MB = 1e6


def synthetic_report(collectives, compiled_flops=9.89e12, bytes_accessed=6.7e10) -> aot.Report:
  """8 devices, 1M tokens per step, the model's FLOPs half of what 8 devices compile."""
  return aot.Report(
    mesh_shape=dict(data=2, fsdp=1, tensor=1, expert=4),
    n_params=0,
    param_bytes=0,
    optimizer_bytes=0,
    table_bytes=0,
    memory={},
    model_flops=8 * 9.89e12 / 2,
    compiled_flops=compiled_flops,
    collectives=[hlo_text.Collective(op, nbytes, group, "", "") for op, nbytes, group in collectives],
    bytes_accessed=bytes_accessed,
    tokens_per_step=1_000_000,
  )


COLLECTIVES = [
  ("all-gather", 450 * MB, 4),  # 450 MB x 3/4
  ("reduce-scatter", 100 * MB, 4),  # the 400 MB input x 3/4
  ("all-reduce", 90 * MB, 2),  # 2 x 90 MB x 1/2
  ("all-to-all", 60 * MB, 4),  # 60 MB x 3/4
  ("collective-permute", 45 * MB, 2),  # 45 MB
  ("all-gather", 50 * MB, 16),  # 50 MB x 15/16: over the DCN on an 8-GPU node, over ICI on a TPU slice
  ("all-reduce", 500 * MB, 1),  # a group of one moves nothing
]


def test_h100_roofline_by_hand():
  p = roofline.project(synthetic_report(COLLECTIVES), hardware.CHIPS["h100"])
  nvlink, dcn = 450e9, 50e9  # one way: half of 900 GB/s; 400 Gb/s
  comm = (337.5 + 300 + 90 + 45 + 45) * MB / nvlink + 46.875 * MB / dcn
  assert p.compute_s == pytest.approx(9.89e12 / 989e12)  # 10 ms
  assert p.memory_s == pytest.approx(6.7e10 / 3.35e12)  # 20 ms
  assert p.comm_s == pytest.approx(comm) and comm == pytest.approx(2.754167e-3, rel=1e-6)
  assert p.step_overlap_s == pytest.approx(0.020)  # memory-bound
  assert p.step_serial_s == pytest.approx(0.020 + comm)
  assert p.tokens_per_s_overlap == pytest.approx(1e6 / 0.020)
  assert p.tokens_per_s_serial == pytest.approx(1e6 / (0.020 + comm))
  assert p.mfu_overlap == pytest.approx(0.25)  # 3.956e13 / (0.020 s x 8 x 989e12)
  assert p.mfu_serial == pytest.approx(3.956e13 / ((0.020 + comm) * 8 * 989e12))


def test_tpu_v5p_keeps_a_16_chip_group_on_ici():
  p = roofline.project(synthetic_report(COLLECTIVES), hardware.CHIPS["v5p"])
  ici = 600e9  # one way: half of 1,200 GB/s
  assert p.comm_s == pytest.approx((337.5 + 300 + 90 + 45 + 45 + 46.875) * MB / ici)
  assert p.compute_s == pytest.approx(9.89e12 / 459e12)
  assert p.memory_s == pytest.approx(6.7e10 / 2765e9)
  assert p.step_overlap_s == pytest.approx(6.7e10 / 2765e9)


def test_communication_bound_step_is_the_collectives_time():
  """One 1 GB all-reduce over 64 GPUs (8 nodes): 2 x 1 GB x 63/64 / 50 GB/s = 39.375 ms, on top of 1 ms compute."""
  report = synthetic_report([("all-reduce", 1e9, 64)], compiled_flops=0.989e12, bytes_accessed=0.0)
  p = roofline.project(report, hardware.CHIPS["h200"])
  assert p.comm_s == pytest.approx(0.039375)
  assert p.step_overlap_s == pytest.approx(0.039375)
  assert p.step_serial_s == pytest.approx(0.040375)


def test_table_has_a_row_per_chip():
  text = roofline.format_projections(
    [roofline.project(synthetic_report(COLLECTIVES), c) for c in hardware.chips("all")]
  )
  rows = [line.split() for line in text.splitlines() if line.lstrip().startswith(("H100", "H200", "TPU"))]
  assert [" ".join(r[:2]) for r in rows] == ["H100 SXM", "H200 SXM", "TPU v5p", "TPU v6e"]
  assert rows[0][2:] == ["10", "20", "2.75", "20", "50,000,000", "25.0%", "22.8", "43,947,995", "22.0%"]


def test_analytic_projection_sums_phase_maxima_and_keeps_the_rest_collectives():
  """Two identical layers of one compute-bound and one HBM-bound phase, plus the compiled collectives outside the
  feed-forward layers (the one from '/mlp/' is the layers' own and is replaced by theirs)."""
  from sparsetx.perf import cost

  layer = cost.LayerCost(
    "sgatlin",
    0,
    (cost.Phase("matmul", 3.35e9, 9.89e12), cost.Phase("gather", 3.35e10, 0.0)),  # 10 ms each on H100
    (cost.CollectiveCost("all-gather", 450 * MB, 4, "x"),),  # 0.75 ms
  )
  compiled = [
    hlo_text.Collective("all-reduce", 90 * MB, 2, "", "jit(train_step)/attention/out"),  # 0.2 ms
    hlo_text.Collective("all-gather", 450 * MB, 4, "", "jit(train_step)/jvp(layers_0)/mlp/gather"),
  ]
  rest = roofline.outside_ffn(compiled)
  assert rest == compiled[:1]
  p = roofline.project_analytic(hardware.CHIPS["h100"], [(2, layer)], 1_000_000, 8 * 9.89e12, 8, rest)
  assert p.compute_s == pytest.approx(0.020) and p.memory_s == pytest.approx(2 * (0.001 + 0.010))
  assert p.comm_s == pytest.approx(2 * 0.75e-3 + 0.2e-3)
  assert p.step_overlap_s == pytest.approx(0.040)  # 2 x (10 + 10 ms), not max(compute, memory) = 22 ms
  assert p.step_serial_s == pytest.approx(0.040 + 1.7e-3)
  assert p.mfu_overlap == pytest.approx(0.25)


def test_an_asynchronous_collective_counts_its_result_only():
  """XLA's GPU compiler (jax 0.12) writes async collectives as `(operands, results) op-start(...)`: the bytes are
  the result's, as for the synchronous form (lines as the compiled H100 step prints them)."""
  text = "\n".join(
    [
      "  %a = ((bf16[4096]{0}), bf16[4096]{0}) all-reduce-start(%x), channel_id=4, replica_groups=[1,4]<=[4]",
      "  %b = ((bf16[256,128]{1,0}, f32[1,64]{1,0}), (bf16[1024,128]{1,0}, f32[4,64]{1,0})) all-gather-start(%y, %z)",
      "  %c = ((f32[1024,128]{1,0}), f32[256,128]{1,0}) reduce-scatter-start(%w), channel_id=1",
      "  %d = bf16[4096]{0} all-reduce(%x), channel_id=5, replica_groups=[1,4]<=[4]",
    ]
  )
  found = hlo_text.collectives(text)
  assert [(c.op, c.nbytes) for c in found] == [
    ("all-reduce", 4096 * 2),
    ("all-gather", 1024 * 128 * 2 + 4 * 64 * 4),
    ("reduce-scatter", 256 * 128 * 4),
    ("all-reduce", 4096 * 2),
  ]

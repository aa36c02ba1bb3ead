"""The programs the stack runs on accelerators lower for them on this CPU-only machine (aot.lower_*): the train
step of every feed-forward type and both block kinds, the evaluation step and the sampler's cached decoding,
for CUDA (the Triton kernels of pre-Hopper GPUs and the Mosaic GPU kernels of Hopper) and TPU (v5p, v6e).

These are the regression tests for hardware no CI machine has. Each counts the sparse layers' row kernels in the
lowered program (kernels/row_gather.py: row_dots, row_accumulate, segment_sums): Triton and TPU kernels by their
names, Mosaic GPU kernels by their custom-call target; the dense types have none. The structural test holds the
shape of what a device runs: no loop that grows with tokens, bf16 tables into the kernels of a bf16 run. Only
lowering runs (no compilation): a few tenths of a second per program. Shapes satisfy Mosaic GPU: d_model 128 in bf16 is one 256-byte row chunk, and 2 x 64
tokens fill its 64-token blocks.
"""

import collections
import re

import jax
import jax.numpy as jnp
import pytest
from conftest import load_config
from jax._src.pallas.mosaic import tpu_info

from sparsetx import config as config_lib
from sparsetx.evaluate import aot as decoding_aot
from sparsetx.kernels.gated_gather import KernelOptions, gated_gather
from sparsetx.models.ffn.common import ACTIVATIONS
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import aot

FFN_TYPES = ("mlp", "swiglu", "moe", "peer", "sgatlin", "fff")
GATHER_TYPES = ("peer", "sgatlin", "fff")
N_LAYERS = 2
TARGETS = {  # name: (lowering platform, TPU chip, kernel.gpu_kernel)
  "cuda-triton": ("cuda", None, "triton"),
  "cuda-mosaic": ("cuda", None, "mosaic"),
  "tpu-v5p": ("tpu", "v5p", "auto"),
  "tpu-v6e": ("tpu", "v6e", "auto"),
}
TRITON, TPU = "__gpu$xla.gpu.triton", "tpu_custom_call"


def lowering_config(ffn_type: str, gpu_kernel: str = "auto", block: str = "sequential"):
  config = load_config("configs/tiny.py", ffn_type)
  config.model.update(d_model=128, n_layers=N_LAYERS, head_dim=64, max_len=64, dtype="bfloat16", block=block)
  config.data.update(seq_len=64, global_batch_size=2, eval_batch_size=2)
  if ffn_type in GATHER_TYPES:
    config.model.ffn.kernel.update(implementation="pallas", gpu_kernel=gpu_kernel)
  config_lib.validate(config)
  return config


ROW_KERNELS = ("row_dots", "row_accumulate", "segment_sums")
FFF_DEPTH = 4  # configs/tiny.py: 5 levels, the top 3 dense (tree_route.DENSE_LEVELS), 2 walked by kernels


def gather_kernels(lowered_text: str, target: str) -> dict:
  """The sparse layers' kernel calls in a lowered program: {kernel name: count} (Mosaic GPU: {'mosaic_gpu': count})."""
  found = collections.Counter()
  for (call, name), count in aot.custom_calls(lowered_text).items():
    if call.startswith("mosaic_gpu"):
      found["mosaic_gpu"] += count
    elif call in (TRITON, TPU) and name in ROW_KERNELS:
      assert call == (TRITON if target.startswith("cuda") else TPU), (call, target)
      found[name] += count
  return dict(found)


def kernel_operands(lowered_text: str, names=ROW_KERNELS) -> list:
  """The operand types ('64x128xbf16', ...) of each sparse-layer kernel call: Triton/TPU calls with one of
  `names`, every Mosaic GPU call."""
  calls = []
  for line in lowered_text.splitlines():
    target = re.search(r"stablehlo\.custom_call @([\w$.]+)", line)
    if not target:
      continue
    name = re.search(r'\b(?:kernel_)?name = "([^"]*)"', line)
    if target[1].startswith("mosaic_gpu") or (name and name[1] in names):
      operands = re.search(r":\s*\((.*)\)\s*->", line)
      calls.append(re.findall(r"tensor<([^>]*)>", operands[1]) if operands else [])
  return calls


def expected_kernels(ffn_type: str, target: str, program: str) -> dict:
  """Per program and sparse layer (kernels/row_gather.py): a forward is row_dots (<w_in, x>; FFF's walk: one per
  walked level instead) and row_accumulate (the gated w_out rows); a backward is one more of each (dy . w_out, dx)
  and two segment_sums (both tables' gradients). train = forward + backward, eval = forward, generate = prefill +
  one decode step. Mosaic GPU's calls carry no kernel name: their total."""
  if ffn_type not in GATHER_TYPES:
    return {}
  forward_dots = FFF_DEPTH + 1 - 3 if ffn_type == "fff" else 1
  forward = {"row_dots": forward_dots, "row_accumulate": 1}
  per_layer = {
    "train": {"row_dots": forward_dots + 1, "row_accumulate": 2, "segment_sums": 2},
    "eval": forward,
    "generate": {name: 2 * n for name, n in forward.items()},
  }[program]
  if target == "cuda-mosaic":
    return {"mosaic_gpu": N_LAYERS * sum(per_layer.values())}
  return {name: N_LAYERS * n for name, n in per_layer.items()}


def cases(targets):
  """(ffn_type, target) pairs; the dense types skip cuda-mosaic, which is the same program as cuda-triton for them."""
  return [(t, target) for t in FFN_TYPES for target in targets if t in GATHER_TYPES or target != "cuda-mosaic"]


@pytest.mark.parametrize("block", ["sequential", "parallel"])
@pytest.mark.parametrize("ffn_type, target", cases(TARGETS))
def test_train_step_lowers_with_the_gated_gather_kernels(ffn_type, target, block):
  platform, chip, gpu_kernel = TARGETS[target]
  text = aot.lower_train_step(lowering_config(ffn_type, gpu_kernel, block), platform, chip)
  assert gather_kernels(text, target) == expected_kernels(ffn_type, target, "train")


@pytest.mark.parametrize("program", ["eval", "generate"])
@pytest.mark.parametrize("ffn_type, target", cases(["cuda-triton", "cuda-mosaic", "tpu-v5p"]))
def test_eval_and_decoding_lower_with_the_gated_gather_kernels(ffn_type, target, program):
  platform, chip, gpu_kernel = TARGETS[target]
  lower = aot.lower_eval_step if program == "eval" else decoding_aot.lower_generate
  text = lower(lowering_config(ffn_type, gpu_kernel), platform, chip)
  assert gather_kernels(text, target) == expected_kernels(ffn_type, target, program)


@pytest.mark.parametrize("gate_inside", [True, False])  # act(g * h) (sgatlin) | g * act(h) (PEER, FFF)
@pytest.mark.parametrize("activation", [*ACTIVATIONS, "gelu_tanh"])
@pytest.mark.parametrize("target", ["cuda-triton", "tpu-v5p"])
def test_kernels_lower_with_every_activation(target, activation, gate_inside):
  """Every activation and gate position lowers around the row kernels (the per-slot arithmetic stays in XLA)."""
  platform, chip, gpu_kernel = TARGETS[target]
  act = (lambda h: jax.nn.gelu(h, approximate=True)) if activation == "gelu_tanh" else ACTIVATIONS[activation]
  options = KernelOptions("pallas", gpu_kernel=gpu_kernel)
  spec = jax.ShapeDtypeStruct
  x, table = spec((64, 128), jnp.bfloat16), spec((256, 128), jnp.float32)
  rows, gates, bias = spec((64, 16), jnp.int32), spec((64, 16), jnp.float32), spec((256,), jnp.float32)

  def loss(x, w_in, w_out, gates, bias, rows):
    return jnp.sum(
      gated_gather(x, w_in, w_out, rows, gates, act, bias, options, gate_inside_activation=gate_inside).astype(
        jnp.float32
      )
      ** 2
    )

  with aot.target_platform(platform, chip):
    traced = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).trace(x, table, table, gates, bias, rows)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
  assert gather_kernels(text, target) == {"row_dots": 2, "row_accumulate": 2, "segment_sums": 2}


@pytest.mark.parametrize(
  "chip, version", [("v5p", tpu_info.ChipVersion.TPU_V5P), ("v6e", tpu_info.ChipVersion.TPU_V6E)]
)
def test_target_platform_reports_the_target_and_restores_this_machine(chip, version):
  with aot.target_platform("tpu", chip):
    assert jax.default_backend() == "tpu"
    assert tpu_info.get_tpu_info().chip_version == version  # what Pallas TPU lowers for
  assert jax.default_backend() == "cpu"
  with aot.target_platform("cuda"):
    assert jax.default_backend() == "gpu"
  assert jax.default_backend() == "cpu"


def test_unknown_targets_are_refused():
  with pytest.raises(config_lib.ConfigError, match="platform 'rocm' cannot be lowered for; use one of"):
    with aot.target_platform("rocm"):
      pass
  with pytest.raises(config_lib.ConfigError, match="TPU chip 'v9' is unknown to Pallas TPU"):
    with aot.target_platform("tpu", "v9"):
      pass
  with pytest.raises(config_lib.ConfigError, match="chip='v5p' is for platform tpu"):
    with aot.target_platform("cuda", "v5p"):
      pass


def test_dry_run_tool_lowers_for_a_platform_and_lists_the_kernels():
  """python -m sparsetx.tools.dry_run --platform=tpu --chip=v6e: one row per custom call, FFF's row kernels per layer."""
  import subprocess
  import sys

  from conftest import REPO

  small = [
    "--config.model.n_layers=2",
    "--config.model.ffn.kernel.implementation=pallas",
    "--config.data.seq_len=64",
    "--config.model.max_len=64",
    "--config.data.global_batch_size=2",
  ]
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "sparsetx.tools.dry_run",
      "--config=configs/tiny.py:fff",
      "--devices=1",
      "--platform=tpu",
      "--chip=v6e",
      *small,
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  assert "train step lowered for tpu (TPU v6e)" in result.stdout
  rows = {
    tuple(line.split()[:2]): int(line.split()[-1])
    for line in result.stdout.splitlines()
    if line.startswith("  tpu_custom_call")
  }
  expected = expected_kernels("fff", "tpu-v6e", "train")
  assert {name: rows[("tpu_custom_call", name)] for name in ROW_KERNELS} == expected
  assert "compiler memory analysis" not in result.stdout  # lowered only


def test_custom_calls_table():
  calls = collections.Counter({("tpu_custom_call", "row_dots"): 2, ("mosaic_gpu_v2", ""): 4})
  lines = aot.format_custom_calls(calls).splitlines()
  assert [line.split() for line in lines[1:]] == [
    ["mosaic_gpu_v2", "-", "4"],
    ["tpu_custom_call", "row_dots", "2"],
  ]
  assert "(none" in aot.format_custom_calls(collections.Counter())


@pytest.mark.parametrize("ici", [dict(data=8), dict(data=4, tensor=2)])
@pytest.mark.parametrize("ffn_type, target", [("sgatlin", "tpu-v5p"), ("fff", "tpu-v6e"), ("peer", "cuda-triton")])
def test_train_step_lowers_on_a_mesh_with_each_device_on_its_tokens(ffn_type, target, ici):
  """On a mesh the kernels sit in a shard_map (Pallas TPU lowers nothing else) and see one device's tokens."""
  platform, chip, gpu_kernel = TARGETS[target]
  config = lowering_config(ffn_type, gpu_kernel)
  config.data.global_batch_size = 8
  config.model.attention = "xla"  # the subject is the gated gather; fused attention on a mesh: test_attention.py
  config.mesh.ici.update(data=1, fsdp=1, tensor=1, expert=1)
  config.mesh.ici.update(**ici)
  text = aot.lower_train_step(config, platform, chip, mesh_lib.make_mesh(config.mesh, jax.devices()[:8]))
  assert gather_kernels(text, target) == expected_kernels(ffn_type, target, "train")
  tokens_per_device, all_tokens = 8 * 64 // ici["data"], 8 * 64
  # Each row_dots call takes an lhs [n, D] (bf16, D = 128) of this device's tokens, padded to the kernel's blocks
  # (row_gather: 64; Pallas TPU: 128-token groups per core), and no operand of all the tokens.
  for types in kernel_operands(text, ("row_dots",)):
    rows = [int(t.split("x")[0]) for t in types if t.endswith("x128xbf16")]
    assert any(tokens_per_device <= n < all_tokens for n in rows) and all_tokens not in rows, types


@pytest.mark.parametrize(
  "ffn_type, ici, placement",
  [
    ("sgatlin", dict(data=2, expert=4), "expert"),
    ("fff", dict(data=2, fsdp=2, expert=2), "expert"),
    ("sgatlin", dict(data=2, expert=4), "fsdp"),
    ("fff", dict(data=2, fsdp=2, expert=2), "data"),
  ],
)
def test_per_device_microbatch_loop_lowers_for_tpu_with_its_kernels(ffn_type, ici, placement):
  """With microbatches the train step's loop is a shard_map manual over every batch axis (train/step.py), the
  tables entering as each device's blocks (placement expert) or whole (fsdp, data: config.model.ffn.placement);
  Pallas TPU lowers a kernel only where every mesh axis is manual: the program lowers for TPU with one forward
  and one backward of kernels per layer, as without the loop, and the kernels read bf16 rows."""
  platform, chip, gpu_kernel = TARGETS["tpu-v5p"]
  config = lowering_config(ffn_type, gpu_kernel)
  config.model.ffn.placement = placement
  config.data.global_batch_size = 16
  config.train.microbatches = 2
  config.model.attention = "xla"
  config.mesh.ici.update(data=1, fsdp=1, tensor=1, expert=1)
  config.mesh.ici.update(**ici)
  text = aot.lower_train_step(config, platform, chip, mesh_lib.make_mesh(config.mesh, jax.devices()[:8]))
  assert gather_kernels(text, "tpu-v5p") == expected_kernels(ffn_type, "tpu-v5p", "train")
  manual = ", ".join(f'"{a}"' for a in ("data", "fsdp", "expert") if a in ici)
  assert f"manual_axes={{{manual}}}" in text
  row_operands = [t for types in kernel_operands(text) for t in types if re.fullmatch(r"\d+x128x\w+", t)]
  assert row_operands and all(t.endswith("xbf16") for t in row_operands), row_operands


LOOP_TRIP_BOUND = 8  # the most trips any device loop of a sparse train step may run (here: none, or 1-trip scans)
TOKENS_PER_DEVICE = (4096, 32768)


@pytest.mark.parametrize("ffn_type", GATHER_TYPES)
@pytest.mark.parametrize("target", ["cuda-triton", "cuda-mosaic", "tpu-v5p"])
def test_sparse_train_step_has_no_loop_that_grows_with_tokens_and_streams_bf16_tables(ffn_type, target):
  """What the device runs: at 4,096 and 32,768 tokens the train step has the same loops, none longer than
  LOOP_TRIP_BOUND trips (the CPU's cache-sized scans stay on the CPU), and a bf16 run hands the kernels bf16
  operands only: tables, tokens and gradients (every [rows, d_model] operand is bf16)."""
  platform, chip, gpu_kernel = TARGETS[target]
  loops = {}
  for tokens in TOKENS_PER_DEVICE:
    config = lowering_config(ffn_type, gpu_kernel)
    config.data.update(seq_len=512, global_batch_size=tokens // 512)
    config.model.max_len = 512
    text = aot.lower_train_step(config_lib.validate(config), platform, chip)
    loops[tokens] = aot.while_loops(text)
    operands = kernel_operands(text)
    assert gather_kernels(text, target) == expected_kernels(ffn_type, target, "train")
    row_operands = [t for types in operands for t in types if re.fullmatch(r"\d+x128x\w+", t)]
    assert row_operands and all(t.endswith("xbf16") for t in row_operands), row_operands
  assert loops[TOKENS_PER_DEVICE[0]] == loops[TOKENS_PER_DEVICE[1]]
  assert all(trips is not None and trips <= LOOP_TRIP_BOUND for trips in loops[TOKENS_PER_DEVICE[1]]), loops


@pytest.mark.parametrize("target", ["tpu-v5p", "cuda-triton"])
def test_moe_train_step_lowers_with_ragged_all_to_alls(target):
  """MoE on data=2 x expert=4 sends each token's pairs to its experts' devices by `ragged_all_to_all`, the op the
  CPU lacks: per layer the x rows out and the outputs back, and their transposes, in bf16 (n = 64 tokens per
  device, k = 2: send buffers of n·k = 128 rows, receive buffers of 4·n·k); the only all-gather is the counts."""
  import re

  platform, chip, gpu_kernel = TARGETS[target]
  config = lowering_config("moe", gpu_kernel)
  config.data.global_batch_size = 8
  config.model.attention = "xla"
  config.mesh.ici.update(data=2, fsdp=1, tensor=1, expert=4)
  text = aot.lower_train_step(config, platform, chip, mesh_lib.make_mesh(config.mesh, jax.devices()[:8]))
  ragged = re.findall(r"custom_call @ragged_all_to_all\(.*\) -> tensor<(\w+)>", text)
  n, k, D = 64, config.model.ffn.experts_per_token, config.model.d_model
  assert collections.Counter(ragged) == {f"{n * k}x{D}xbf16": 2 * N_LAYERS, f"{4 * n * k}x{D}xbf16": 2 * N_LAYERS}
  assert (
    re.findall(r"stablehlo.all_gather.*-> tensor<([^>]*)>", text) == [f"4x{config.model.ffn.n_experts}xi32"] * N_LAYERS
  )
  assert "reduce_scatter" not in text

"""The programs the stack runs on accelerators lower for them on this CPU-only machine (aot.lower_*): the train
step of every feed-forward type and both block kinds, the evaluation step and the sampler's cached decoding,
for CUDA (the Triton kernels of pre-Hopper GPUs and the Mosaic GPU kernels of Hopper) and TPU (v5p, v6e).

These are the regression tests for hardware no CI machine has. Each counts the gated-gather kernels in the
lowered program: Triton and TPU kernels by their names (gated_gather_forward / _backward, one of each per
sparse layer in a train step), Mosaic GPU kernels by their custom-call target (row_dots and row_accumulate,
forward and backward); the dense types have none. Only lowering runs (no compilation): a few tenths of a
second per program. Shapes satisfy Mosaic GPU: d_model 128 in bf16 is one 256-byte row chunk, and 2 x 64
tokens fill its 64-token blocks.
"""

import collections

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


def gather_kernels(lowered_text: str, target: str) -> dict:
  """The gated-gather kernel calls in a lowered program: {kernel name: count} (Mosaic GPU: {'mosaic_gpu': count})."""
  found = collections.Counter()
  for (call, name), count in aot.custom_calls(lowered_text).items():
    if call.startswith("mosaic_gpu"):
      found["mosaic_gpu"] += count
    elif call in (TRITON, TPU) and name.startswith("gated_gather"):
      assert call == (TRITON if target.startswith("cuda") else TPU), (call, target)
      found[name] += count
  return dict(found)


def expected_kernels(ffn_type: str, target: str, program: str) -> dict:
  """Per program and sparse layer: train = forward + backward, eval = forward, generate = prefill + one decode step.

  Mosaic GPU runs each half as row_dots (<w_in, x>) and row_accumulate (sum of gated w_out rows): two
  kernels for a forward and two for a backward, except FFF's forward, whose walk already holds the dots."""
  if ffn_type not in GATHER_TYPES:
    return {}
  if target == "cuda-mosaic":
    forward = 1 if ffn_type == "fff" else 2
    per_layer = {"train": forward + 2, "eval": forward, "generate": 2 * forward}[program]
    return {"mosaic_gpu": N_LAYERS * per_layer}
  if program == "train":
    return {"gated_gather_forward": N_LAYERS, "gated_gather_backward": N_LAYERS}
  return {"gated_gather_forward": N_LAYERS * (2 if program == "generate" else 1)}


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
  """The activation runs inside the Triton and TPU kernels; exact GELU's erf is the one that needs kernel_math."""
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
  assert gather_kernels(text, target) == {"gated_gather_forward": 1, "gated_gather_backward": 1}


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
  """python -m sparsetx.tools.dry_run --platform=tpu --chip=v6e: one row per custom call, the gated gather's two kernels per layer."""
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
  assert rows[("tpu_custom_call", "gated_gather_forward")] == rows[("tpu_custom_call", "gated_gather_backward")] == 2
  assert "compiler memory analysis" not in result.stdout  # lowered only


def test_custom_calls_table():
  calls = collections.Counter({("tpu_custom_call", "gated_gather_forward"): 2, ("mosaic_gpu_v2", ""): 4})
  lines = aot.format_custom_calls(calls).splitlines()
  assert [line.split() for line in lines[1:]] == [
    ["mosaic_gpu_v2", "-", "4"],
    ["tpu_custom_call", "gated_gather_forward", "2"],
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
  tokens_per_device = 8 * 64 // ici["data"]
  operands = [
    line.split("->")[-1] for line in text.splitlines() if "gated_gather_forward" in line and "custom_call" in line
  ]
  assert operands and all(line.lstrip(" (").startswith(f"tensor<{tokens_per_device}x128xbf16>") for line in operands)

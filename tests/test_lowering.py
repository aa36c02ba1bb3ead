"""The programs the stack runs on accelerators, lowered for a topology's devices on this CPU-only machine
(aot.lower_*, parallel/topology.py): the train step with the parallel block, the evaluation step and the
sampler's cached decoding, for A100 (Triton), H100 (Mosaic GPU) and TPU (v5p, v6e), and the train step at ladder
token counts. tests/test_compile.py compiles the train step itself; these cases hold what lowering alone shows
cheaply (a few tenths of a second a program): the kernels' count per program, their operand dtypes and the loops.

Each counts the sparse layers' row kernels in the lowered program (kernels/rows/row_gather.py: row_dots,
row_accumulate, segment_sums): Triton and TPU kernels by their names, Mosaic GPU kernels by their custom-call
target; the dense types have none. Shapes satisfy Mosaic GPU: d_model 128 in bf16 is one 256-byte row chunk, and
2 x 64 tokens fill its 64-token blocks.
"""

import collections
import re

import jax
import jax.numpy as jnp
import pytest
from conftest import load_config

from sparsetx import config as config_lib
from sparsetx.evaluate import aot as decoding_aot
from sparsetx.kernels import platform, registry
from sparsetx.kernels.device import TracedDevice
from sparsetx.kernels.rows.gated_gather import KernelOptions, gated_gather
from sparsetx.measure import aot
from sparsetx.models.ffn.common import ACTIVATIONS
from sparsetx.perf import hlo_text

FFN_TYPES = ("mlp", "swiglu", "moe", "peer", "sgatlin", "fff")
GATHER_TYPES = ("peer", "sgatlin", "fff")
N_LAYERS = 2
TARGETS = {  # name: (topology of 8 devices, kernel.implementation)
  "cuda-triton": ("a100:1x1x8", "triton"),
  "cuda-mosaic": ("h100:1x1x8", "mosaic"),  # auto takes Triton rows first (registry.DEFAULT_ORDER)
  "tpu-v5p": ("v5p:2x2x2", "tpu"),
  "tpu-v6e": ("v6e:2x4", "tpu"),
}
TRITON, TPU = "__gpu$xla.gpu.triton", "tpu_custom_call"


def lowering_config(ffn_type: str, implementation: str = "triton,tpu", block: str = "sequential"):
  config = load_config("configs/tiny.py", ffn_type)
  config.model.update(d_model=128, n_layers=N_LAYERS, head_dim=64, max_len=64, dtype="bfloat16", block=block)
  config.data.update(seq_len=64, global_batch_size=2, eval_batch_size=2)
  if ffn_type in GATHER_TYPES:
    config.model.ffn.kernel.update(implementation=implementation)
  config_lib.validate(config)
  return config


ROW_KERNELS = ("row_dots", "row_accumulate", "segment_sums")
FFF_DEPTH = 4  # configs/tiny.py: 5 levels, the top 3 dense (tree_route.DENSE_LEVELS), 2 walked by kernels


def gather_kernels(lowered_text: str, target: str) -> dict:
  """The sparse layers' kernel calls in a lowered program: {kernel name: count} (Mosaic GPU: {'mosaic_gpu': count})."""
  found = collections.Counter()
  for (call, name), count in hlo_text.custom_calls(lowered_text).items():
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
  """Per program and sparse layer (kernels/rows/row_gather.py): a forward is row_dots (<w_in, x>; FFF's walk: one per
  walked level instead) and row_accumulate (the gated w_out rows); a backward is one more of each (dy . w_out, dx)
  and four segment_sums (per table's gradient: its rows cut at kernel.segment_chunk pairs, then the cut rows
  combined, kernels/rows/row_chunks.py; every case here has more pairs than one chunk). train = forward + backward,
  eval = forward, generate = prefill + one decode step. Mosaic GPU's calls carry no kernel name: their total."""
  if ffn_type not in GATHER_TYPES:
    return {}
  forward_dots = FFF_DEPTH + 1 - 3 if ffn_type == "fff" else 1
  forward = {"row_dots": forward_dots, "row_accumulate": 1}
  per_layer = {
    "train": {"row_dots": forward_dots + 1, "row_accumulate": 2, "segment_sums": 4},
    "eval": forward,
    "generate": {name: 2 * n for name, n in forward.items()},
  }[program]
  if target == "cuda-mosaic":
    return {"mosaic_gpu": N_LAYERS * sum(per_layer.values())}
  return {name: N_LAYERS * n for name, n in per_layer.items()}


def cases(targets):
  """(ffn_type, target) pairs; the dense types skip cuda-mosaic, which is the same program as cuda-triton for them."""
  return [(t, target) for t in FFN_TYPES for target in targets if t in GATHER_TYPES or target != "cuda-mosaic"]


@pytest.mark.parametrize("ffn_type, target", cases(TARGETS))
def test_train_step_with_the_parallel_block_lowers_with_the_gated_gather_kernels(ffn_type, target):
  """The parallel block (attention and feed-forward side by side); the sequential one: tests/test_compile.py."""
  topology, implementation = TARGETS[target]
  text = aot.lower_train_step(lowering_config(ffn_type, implementation, "parallel"), topology)
  assert gather_kernels(text, target) == expected_kernels(ffn_type, target, "train")


@pytest.mark.parametrize("program", ["eval", "generate"])
@pytest.mark.parametrize("ffn_type, target", cases(["cuda-triton", "cuda-mosaic", "tpu-v5p"]))
def test_eval_and_decoding_lower_with_the_gated_gather_kernels(ffn_type, target, program):
  topology, implementation = TARGETS[target]
  lower = aot.lower_eval_step if program == "eval" else decoding_aot.lower_generate
  text = lower(lowering_config(ffn_type, implementation), topology)
  assert gather_kernels(text, target) == expected_kernels(ffn_type, target, program)


@pytest.mark.parametrize("gate_inside", [True, False])  # act(g * h) (sgatlin) | g * act(h) (PEER, FFF)
@pytest.mark.parametrize("activation", [*ACTIVATIONS, "gelu_tanh"])
@pytest.mark.parametrize("target", ["cuda-triton", "tpu-v5p"])
def test_kernels_lower_with_every_activation(target, activation, gate_inside):
  """Every activation and gate position lowers around the row kernels (the per-slot arithmetic stays in XLA)."""
  topology, implementation = TARGETS[target]
  act = (lambda h: jax.nn.gelu(h, approximate=True)) if activation == "gelu_tanh" else ACTIVATIONS[activation]
  options = KernelOptions(implementation)
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

  with aot.on_topology(topology):
    traced = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).trace(x, table, table, gates, bias, rows)
    text = traced.lower().as_text()
  assert gather_kernels(text, target) == {"row_dots": 2, "row_accumulate": 2, "segment_sums": 4}


@pytest.mark.parametrize(
  "topology, device",
  [
    ("v5p:2x2x1", TracedDevice("tpu", "TPU v5", 2)),
    ("v6e:2x2", TracedDevice("tpu", "TPU v6 lite", 1)),
    ("h100:1x1x4", TracedDevice("gpu", "NVIDIA H100 80GB HBM3", 132, 232448)),  # h100.txtpb's shared memory
    ("a100:1x1x4", TracedDevice("gpu", "NVIDIA A100-SXM4-80GB", 108, 166912)),
  ],
)
def test_programs_traced_on_a_topology_take_its_device(topology, device):
  """kernels/platform.target reads the active mesh's devices: the chip and its cores for Pallas TPU, a GPU's
  shared memory per block for Mosaic GPU's tilings, Mosaic GPU's grouped matmul from Hopper on
  (kernel.implementation=auto); outside, this machine's CPU again."""
  with aot.on_topology(topology):
    assert platform.target() == device
    call = dict(dtype="bfloat16", k=64, n=64)
    want = "mosaic" if "H100" in device.device_kind else "tpu" if device.platform == "tpu" else "triton"
    assert registry.resolve("grouped_matmul", KernelOptions(), "any", call).name == want
  assert platform.target().platform == "cpu"


def test_unknown_topologies_are_refused_in_one_line():
  with pytest.raises(config_lib.ConfigError, match="topology 'rocm:1x1x8' is neither a TPU topology"):
    aot.topology_mesh(lowering_config("mlp"), "rocm:1x1x8")
  with pytest.raises(config_lib.ConfigError, match="GPU target 'b200' is not described; use one of h100, h200, a100"):
    aot.topology_mesh(lowering_config("mlp"), "b200:1x1x8")
  with pytest.raises(config_lib.ConfigError, match="libtpu knows no TPU topology 'v9:2x2'"):
    aot.topology_mesh(lowering_config("mlp"), "v9:2x2")
  config = lowering_config("mlp")
  config.mesh.ici.update(data=3)
  with pytest.raises(config_lib.ConfigError, match="does not divide 4 devices"):
    aot.topology_mesh(config, "v5p:2x2x1")


def test_custom_calls_table():
  calls = collections.Counter({("tpu_custom_call", "row_dots"): 2, ("mosaic_gpu_v2", ""): 4})
  lines = hlo_text.format_custom_calls(calls).splitlines()
  assert [line.split() for line in lines[1:]] == [
    ["mosaic_gpu_v2", "-", "4"],
    ["tpu_custom_call", "row_dots", "2"],
  ]
  assert "(none" in hlo_text.format_custom_calls(collections.Counter())


@pytest.mark.parametrize("ici", [dict(data=8), dict(data=4, tensor=2)])
@pytest.mark.parametrize("ffn_type, target", [("sgatlin", "tpu-v5p"), ("fff", "tpu-v6e"), ("peer", "cuda-triton")])
def test_train_step_lowers_on_a_mesh_with_each_device_on_its_tokens(ffn_type, target, ici):
  """On a mesh the kernels sit in a shard_map (Pallas TPU lowers nothing else) and see one device's tokens."""
  topology, implementation = TARGETS[target]
  config = lowering_config(ffn_type, implementation)
  config.data.update(global_batch_size=8, eval_batch_size=8)
  config.model.attention = "xla"  # the subject is the gated gather; fused attention on a mesh: test_attention.py
  config.mesh.ici.update(data=1, fsdp=1, tensor=1, expert=1)
  config.mesh.ici.update(**ici)
  text = aot.lower_train_step(config, topology, 8)
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
  """With microbatches the train step's loop is a shard_map manual over every batch axis (parallel/microbatches.py), the
  tables entering as each device's blocks (placement expert) or whole (fsdp, data: config.model.ffn.placement);
  Pallas TPU lowers a kernel only where every mesh axis is manual: the program lowers for TPU with one forward
  and one backward of kernels per layer, as without the loop, and the kernels read bf16 rows."""
  topology, implementation = TARGETS["tpu-v5p"]
  config = lowering_config(ffn_type, implementation)
  config.model.ffn.placement = placement
  config.data.update(global_batch_size=16, eval_batch_size=16)
  config.train.microbatches = 2
  config.model.attention = "xla"
  config.mesh.ici.update(data=1, fsdp=1, tensor=1, expert=1)
  config.mesh.ici.update(**ici)
  text = aot.lower_train_step(config, topology, 8)
  assert gather_kernels(text, "tpu-v5p") == expected_kernels(ffn_type, "tpu-v5p", "train")
  manual = ", ".join(f'"{a}"' for a in ("data", "fsdp", "expert") if a in ici)
  assert f"manual_axes={{{manual}}}" in text
  assert_bf16_rows(text)


# bf16 rows: as bf16, or on TPU as uint32 words of bf16 pairs (tpu_layout.as_words; a float32 table stays f32)
BF16_ROWS = ("xbf16", "xui32")


def assert_bf16_rows(text: str) -> None:
  """Every [rows, d_model] operand of a sparse-layer kernel is bf16 (on TPU packed in uint32 words), but the float32
  partial sums each table's combine of cut rows reads (kernels/rows/row_chunks.py): one per table and layer."""
  # int32 operands are ids and row ranges (Mosaic GPU's segment_sums takes its [2, R] ranges), not rows
  rows = [t for types in kernel_operands(text) for t in types if re.fullmatch(r"\d+x128x\w+", t) and "xi32" not in t]
  partials = [t for t in rows if t.endswith("xf32")]
  assert rows and all(t.endswith(BF16_ROWS) for t in rows if t not in partials), rows
  assert len(partials) == 2 * N_LAYERS, rows


LOOP_TRIP_BOUND = 8  # the most trips any device loop of a sparse train step may run (here: none, or 1-trip scans)
TOKENS_PER_DEVICE = (4096, 32768)


@pytest.mark.parametrize("ffn_type", GATHER_TYPES)
@pytest.mark.parametrize("target", ["cuda-triton", "cuda-mosaic", "tpu-v5p"])
def test_sparse_train_step_has_no_loop_that_grows_with_tokens_and_streams_bf16_tables(ffn_type, target):
  """What the device runs: at 4,096 and 32,768 tokens the train step has the same loops, none longer than
  LOOP_TRIP_BOUND trips (the CPU's cache-sized scans stay on the CPU), and a bf16 run hands the kernels bf16
  operands: tables, tokens and gradients (every [rows, d_model] operand is bf16 but the cut rows' float32
  partial sums)."""
  topology, implementation = TARGETS[target]
  loops = {}
  for tokens in TOKENS_PER_DEVICE:
    config = lowering_config(ffn_type, implementation)
    config.data.update(seq_len=512, global_batch_size=tokens // 512)
    config.model.max_len = 512
    text = aot.lower_train_step(config_lib.validate(config), topology)
    loops[tokens] = hlo_text.while_loops(text)
    assert gather_kernels(text, target) == expected_kernels(ffn_type, target, "train")
    assert_bf16_rows(text)
  assert loops[TOKENS_PER_DEVICE[0]] == loops[TOKENS_PER_DEVICE[1]]
  assert all(trips is not None and trips <= LOOP_TRIP_BOUND for trips in loops[TOKENS_PER_DEVICE[1]]), loops

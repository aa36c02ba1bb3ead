"""Per-device memory of a train step as a GPU or TPU runs it: the CPU-compiled figure corrected analytically, and
the same count before anything is built (what a config file plans remat and micro-batches by).

The derivation of each term is in device_memory's docstring; docs/modules.md (sparsetx/measure/aot.py) says how
the dry run prints it.
"""

from typing import NamedTuple

import flax.linen as nn
import jax.numpy as jnp

from sparsetx import config as config_lib
from sparsetx.models import ladder
from sparsetx.models.ffn.registry import SPECS
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.parallel import per_device


def format_bytes(nbytes: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(nbytes) < 1024 or unit == "TiB":
      return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
    nbytes /= 1024


class DeviceMemory(NamedTuple):
  """Per-device bytes of a train step as a GPU/TPU runs it (see device_memory); every field is bytes."""

  compiled: int  # the CPU program: arguments + outputs - aliased + temporaries (the compiler's memory analysis)
  state: int  # arguments + outputs - aliased: parameters, optimizer state, batch (the same on every backend)
  gradients: int  # float32 gradients as the loop holds them, twice with micro-batches (running sum, one micro-batch's)
  gathered: int  # parameters held whole for the per-device microbatch loop, beyond their stored shards
  saved: int  # activations the forward keeps for the backward, all layers, under config.model.remat
  layer: int  # one block's recomputed forward and its cotangents during its backward (remat none: 0, in `saved`)
  head: int  # the LM head's float32 logits, their softmax and their cotangent over one micro-batch
  tokens: int  # tokens per device per micro-batch

  @property
  def device(self) -> int:
    return self.state + self.gradients + self.gathered + self.saved + self.layer + self.head


def layer_residual_bytes(config, tokens: int, policy: str, expert: int = 1) -> int:
  """Bytes one block keeps for its backward over `tokens` tokens under a remat policy, with fused attention.

  full: the block's input [n, D]. none: the inputs of its matmuls and nonlinearities: both norms' outputs
  (2 nD), q, k, v and the attention output (4 n H K), the flash kernel's logsumexp (n H float32), the residual
  stream after attention (nD), and the feed-forward layer's (its FfnSpec.residual_bytes): mlp/swiglu the hidden
  (2 or 3 nF), moe its experts' hidden and its dispatch's sorted rows and outputs (k (2 nF + 2 nD)), sgatlin/peer
  the selected slots' scores and indices (n C k, float32 and int32), the gated pre-activations (n C k) and the
  product-key router's scores (2 n C sqrt(F) float32), fff the visited nodes (n trees (depth+1), float32 and
  int32); a sparse layer on `expert` > 1 devices also keeps the expert group's gathered tokens (expert n D).
  save_routing: the block's input and attention output (2 nD) and the routing its feed-forward layer names
  (`routing_bytes`). save_dots / dots_saveable / dots_with_no_batch_dims_saveable keep the matmul outputs, about
  the same as none. Compute-dtype bytes (config.model.dtype) except where noted."""
  model = config.model
  itemsize = jnp.dtype(model.dtype).itemsize
  D = model.d_model
  if policy == "full":
    return tokens * D * itemsize
  if policy == "save_routing":
    return 2 * tokens * D * itemsize + routing_bytes(model.ffn, tokens)
  heads = D // model.head_dim
  attention = tokens * (2 * D + 4 * heads * model.head_dim + D) * itemsize + tokens * heads * 4
  spec = SPECS[model.ffn.type]
  feed_forward = spec.residual_bytes(model, model.ffn, tokens, itemsize)
  if spec.sparse and expert > 1:
    feed_forward += expert * tokens * D * itemsize
  return attention + feed_forward


def routing_bytes(ffn, tokens: int) -> int:
  """What remat=save_routing keeps of one feed-forward layer over `tokens` tokens: its type's spec says (0 for a type
  that saves nothing by name)."""
  spec = SPECS[ffn.type]
  return spec.routing_bytes(ffn, tokens) if spec.routing_bytes else 0


def activation_bytes(config, tokens: int, vocab_shards: int = 1, expert: int = 1) -> tuple[int, int, int]:
  """(saved, layer, head): DeviceMemory's activation terms for `tokens` tokens per device per micro-batch."""
  policy = config_lib.remat_policy(config.model)
  saved = config.model.n_layers * layer_residual_bytes(config, tokens, policy, expert)
  layer = 0 if policy == "none" else 2 * layer_residual_bytes(config, tokens, "none", expert)
  # The LM head's float32 logits, softmax and cotangent: one vocabulary tile at a time under the chunked loss.
  tiles = config_lib.loss_chunk_count(config.model.vocab_size, config.train.get("loss_chunks", 0))
  head = 3 * 4 * tokens * -(-config.model.vocab_size // tiles) // vocab_shards
  return saved, layer, head


def device_memory(config, mesh, report) -> DeviceMemory:
  """The per-device memory of the train step on a GPU/TPU, next to the CPU-compiled figure it corrects; `report`
  is the compiled step's train/aot.Report (its memory analysis, param_bytes and loop_param_bytes).

  The CPU program is not the device's in two ways, so its temporaries are replaced by an analytic count:
  - attention: the CPU runs the XLA attention, which materializes [B,H,T,T] float32 logits and probabilities
    (and keeps several per layer); cuDNN, splash and the Pallas flash kernel keep only the [B,H,T] logsumexp.
  - remat: XLA on CPU drops the remat barriers (the same step compiles to about the same temporaries under
    remat=none and full), so its program keeps every layer's residuals; an accelerator
    keeps only what config.model.remat saves (layer_residual_bytes) and recomputes one block at a time.
  The device figure is: state (arguments + outputs - aliased, exact from the compile) + float32 gradients (the
  parameters' per-device bytes in float32 as the step holds them: with micro-batches, twice, for the running sum,
  and as the per-device loop takes the parameters, whole but for the tables' blocks, `Report.loop_param_bytes`) +
  the parameters that loop gathers whole beyond their stored shards + every layer's saved
  residuals for one micro-batch + one block's recomputed residuals and their cotangents (2x remat=none's, when
  remat is not none) + the LM head's float32 logits, softmax and cotangent over one vocabulary tile of the chunked
  loss (3 x 4 n V / loss_chunks bytes over the vocab's shards of the logits). It omits XLA's fusion scratch and
  fragmentation: a lower bound to leave headroom above (the accelerator's allocator reserves some of the HBM too).
  """
  memory = report.memory
  state = memory["argument"] + memory["output"] - memory["alias"]
  n = (
    config.data.global_batch_size
    // config.train.microbatches
    // per_device.shards(mesh, mesh_lib.batch_axes(mesh, config.mesh.rules))
    * config.data.seq_len
  )
  loop_bytes = max(report.loop_param_bytes, report.param_bytes)
  gradients = 4 * loop_bytes // jnp.dtype(config.model.param_dtype).itemsize
  gradients *= 2 if config.train.microbatches > 1 else 1
  logits_spec = nn.logical_to_mesh_axes(("batch", "length", "vocab"), tuple(config.mesh.rules))[-1]
  vocab_axes = logits_spec if isinstance(logits_spec, tuple) else (logits_spec,) if logits_spec else ()
  vocab_shards = per_device.shards(mesh, vocab_axes)  # often 1: the batch takes `vocab`'s mesh axes
  saved, layer, head = activation_bytes(config, n, vocab_shards, mesh.shape["expert"])
  gathered = loop_bytes - report.param_bytes
  return DeviceMemory(state + memory["temp"], state, gradients, gathered, saved, layer, head, n)


def planned_device_bytes(config, devices: int, expert: int) -> int:
  """DeviceMemory.device before anything is built (a config file choosing remat and micro-batches): parameters
  from the ladder's count, the sparse tables and the vocabulary split over `expert`, the rest replicated; float32
  Adam moments; float32 gradients, with micro-batches twice and as the per-device loop holds them (the tables
  split, the vocabulary gathered whole, as are its parameters); the activations of activation_bytes with the
  batch over all `devices`. The tables are taken as placed `expert` (whole under fsdp and data in that loop)."""
  model = config.model
  counts = ladder.param_counts(model)
  embeddings = model.vocab_size * model.d_model * (1 if model.tie_embeddings else 2)
  tables = counts["ffn_total"] if SPECS[model.ffn.type].units is not None else 0
  params = (embeddings + tables) / expert + counts["total"] - embeddings - tables
  itemsize = jnp.dtype(model.param_dtype).itemsize
  gradients = 4 * params
  if config.train.microbatches > 1:  # two float32 sums of the loop's parameters, and those gathered whole for it
    loop = tables / expert + counts["total"] - tables
    gradients = 2 * 4 * loop + (loop - params) * itemsize
  state = params * (itemsize + 8) + gradients
  tokens = config.data.global_batch_size // config.train.microbatches // devices * config.data.seq_len
  return int(state + sum(activation_bytes(config, tokens, expert=expert)))


def format_device_memory(memory: DeviceMemory, chips=()) -> str:
  """The compiled (CPU) figure, the device estimate by term, and its share of each chip's HBM."""
  lines = [
    f"per-device memory, compiled CPU program  {format_bytes(memory.compiled)} (XLA attention, remat dropped)",
    f"per-device memory, device estimate        {format_bytes(memory.device)} (fused attention, remat honoured;"
    " plan/memory.device_memory)",
    f"  state {format_bytes(memory.state)}, gradients {format_bytes(memory.gradients)}, parameters gathered for the loop"
    f" {format_bytes(memory.gathered)}, saved activations {format_bytes(memory.saved)},"
    f" one block's backward {format_bytes(memory.layer)}, LM head {format_bytes(memory.head)} ({memory.tokens:,} tokens per"
    " micro-batch)",
  ]
  lines += [
    f"  of {chip.name} HBM ({format_bytes(chip.hbm_bytes)}): {memory.device / chip.hbm_bytes:.0%}" for chip in chips
  ]
  return "\n".join(lines)

"""A rung of the sgatlin paper's scaling ladder: `--config=configs/ladder.py:sgatlin,4[,TARGET]`.

d_model = 128 * scale, n_layers = 2 * scale, d_ffw per type (Listing 2; see sparsetx/models/ladder.py,
which also defines the FFF rung). GPT-2 vocabulary padded to 50,304, context 2048, remat per block.

TARGET (optional) sizes the run for a machine (sparsetx/plan/targets.py): the paper's 128 x 2,048 tokens
per step, the sparse layer's units split over `expert` inside one node or slice (NVLink / ICI), `data` over the
rest and over the nodes (DCN), the vocabulary over `expert` (nothing large replicated), micro-batches so each
device holds at most 8,192 tokens at a time on an 80 GB chip (scaled with the HBM), and the cheapest remat of
`none`, `save_routing` (the routing kept, no router recomputed) and `full` whose planned device memory
(plan/memory.planned_device_bytes) leaves half the HBM free for what the analytic count omits. sparsetx/tools/dry_run.py prints the device memory of
the compiled step (plan/memory.device_memory). E.g.
  configs/ladder.py:sgatlin,5,h100x8    one node of 8 H100s: expert=8, 4 micro-batches of 2 rows per GPU
  configs/ladder.py:fff,2,h200x8        one node of 8 H200s: expert=4 (FFF's 4 trees), data=2
  configs/ladder.py:sgatlin,8,h100x8x4  4 nodes: expert=8 on NVLink, data=4 over the DCN
  configs/ladder.py:sgatlin,2,v5p-64    a v5p slice of 32 chips: expert=16 (sgatlin's 16 channels), data=2
Forms: h100xG[xN], h200xG[xN], v5p-C[xN] (C TensorCores, 2 per chip), v6e-C[xN] (C chips).
A rung on a target trains from a pre-tokenized corpus (config.data.require_tokenized): sparsetx-tokenize
--config=... --output_dir=DIR once, then train with --config.data.tokenized_dir=DIR (README, Data).
"""

from sparsetx import config as config_lib
from sparsetx.models import ladder
from sparsetx.models.ffn.registry import SPECS
from sparsetx.plan import memory, targets


def units(model) -> int | None:
  """What `expert` splits in the rung's feed-forward layer (channels, trees, experts); None for a dense one."""
  spec = SPECS[model.ffn.type]
  return None if spec.units is None else model.ffn[spec.units.field]


def get_config(arg: str = "sgatlin,2"):
  parts = [p.strip() for p in arg.split(",")]
  if len(parts) not in (2, 3) or not parts[1].isdigit():
    raise config_lib.ConfigError(
      f"configs/ladder.py:{arg} must be 'FFN,SCALE[,TARGET]', e.g. configs/ladder.py:sgatlin,4 or "
      f"configs/ladder.py:sgatlin,5,h100x8 (FFN one of {', '.join(config_lib.FFN_TYPES)}; SCALE 2..8 in the paper; "
      f"TARGET one of {targets.EXAMPLES})."
    )
  config = config_lib.default_config()
  config.model = ladder.ladder_model_config(int(parts[1]), parts[0])
  if len(parts) == 3:
    config.model.ffn.kernel.implementation = "auto"
    config.data.update(seq_len=ladder.LADDER_SEQ_LEN, global_batch_size=128, eval_batch_size=128)
    targets.apply(config, parts[2], units(config.model))
    config.model.remat = remat_for(config, targets.parse(parts[2]))
    config.data.require_tokenized = (
      True  # trains on --config.data.tokenized_dir (sparsetx-tokenize); a dry run needs no data
    )
  return config


def remat_for(config, target) -> str:
  """The cheapest policy in recompute (none, save_routing, full) whose step is planned (plan/memory.py) to use at
  most half of a chip's HBM; `full` when none does."""
  expert = targets.expert_size(target, units(config.model))
  for policy in ("none", "save_routing"):
    plain = config.copy_and_resolve_references()
    plain.model.remat = policy
    if memory.planned_device_bytes(plain, target.devices, expert) <= target.chip.hbm_bytes / 2:
      return policy
  return "full"

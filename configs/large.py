"""The largest sgatlin models with expert-parallel meshes: `--config=configs/large.py:MODEL,TARGET`.

MODEL:
  sgatlin8   the paper's ladder at scale 8: d_model 1024, 16 layers, C=16 channels of
             d_ffw = 112**2 neurons (6.7B parameters, 6.6B of them in the tables)
  sgatlin4b  d_model 2048, 24 layers, C=16 channels of 48**2 neurons (4.2B parameters)
TARGET (the mesh; the tables are split by channel over `expert`, see sparsetx/parallel/expert_groups.py):
  h100       nodes of 8 H100s: expert=8 inside a node (NVLink carries the token all-gathers and
             reduce-scatters), data over the nodes (DCN) and any remaining local devices
  v5p        one TPU v5p slice (all ICI): expert=16, one channel per chip, data over the rest
             (v5p-128: 64 chips, data=4)

fsdp stays 1: channel splitting moves the fewest bytes. (An fsdp axis would also split the tables'
d_model; the layer then sends tokens to the d-slices, all-to-all, and sums partial dots, which costs
more collectives per token.) The embeddings and LM head are split over the vocabulary on the expert
axis instead, so no large parameter is replicated. Try one on simulated devices first:
  .venv/bin/python -m sparsetx.tools.dry_run --config=configs/large.py:sgatlin8,h100 --devices=64
"""

from sparsetx import config as config_lib
from sparsetx.models import ladder
from sparsetx.plan import targets

TARGETS = {
  "h100": dict(ici=dict(data=-1, fsdp=1, tensor=1, expert=8), dcn=dict(data=-1, fsdp=1, tensor=1, expert=1)),
  "v5p": dict(ici=dict(data=-1, fsdp=1, tensor=1, expert=16), dcn=dict(data=1, fsdp=1, tensor=1, expert=1)),
}


def _sgatlin4b():
  model = ladder.ladder_model_config(8, "sgatlin")
  model.update(d_model=2048, n_layers=24, head_dim=128)
  model.ffn.update(n_channels=16, d_ffw=48**2, top_k=8, d_key=128)
  return model


MODELS = {"sgatlin8": lambda: ladder.ladder_model_config(8, "sgatlin"), "sgatlin4b": _sgatlin4b}


def get_config(arg: str = "sgatlin8,h100"):
  parts = [p.strip() for p in arg.split(",")]
  if len(parts) != 2 or parts[0] not in MODELS or parts[1] not in TARGETS:
    raise config_lib.ConfigError(
      f"configs/large.py:{arg} must be 'MODEL,TARGET' with MODEL one of {', '.join(MODELS)} and TARGET one of "
      f"{', '.join(TARGETS)}, e.g. configs/large.py:sgatlin8,h100."
    )
  config = config_lib.default_config()
  config.model = MODELS[parts[0]]()
  config.model.ffn.kernel.implementation = "auto"
  config.mesh.update(TARGETS[parts[1]])
  config.mesh.rules = targets.vocab_split_rules(config_lib.DEFAULT_RULES)
  config.data.update(seq_len=2048, global_batch_size=256, eval_batch_size=256)
  # 4 micro-batches: one 2048-token row per device at a time, so the expert group's gathered tokens
  # (E rows per device) stay small next to the tables (sparsetx/tools/dry_run.py shows temporaries).
  config.train.update(steps=100_000, warmup_steps=2_000, microbatches=4)
  config.train.bad_steps = "skip"  # weeks on a pod: a spike costs one skipped update, not the run
  return config

"""The config schema: every knob with its default, and the helpers that read per-layer and per-run choices.

Configs are `ml_collections.ConfigDict`s; the files under `configs/` start from `default_config()` and
override fields (also on the command line, `--config.a.b=v`). The checks live in checks.py and
ffn_checks.py, the file checks in sparsetx.data, so this module stays the one place to read a field's
meaning and default.
"""

import ml_collections

from sparsetx.config.errors import ConfigError
from sparsetx.config.errors import require as _require
from sparsetx.config.placements import PLACEMENTS

BLOCK_KINDS = ("sequential", "parallel")
NORM_KINDS = ("rmsnorm", "layernorm")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash")  # see sparsetx/models/attention.py
# Rematerialization per block: none, full (recompute everything), or a jax.checkpoint_policies name (what is saved).
# save_dots = dots_saveable; save_routing keeps the attention output and the sparse layers' routing (scopes.py).
REMAT_POLICIES = ("none", "full", "save_routing", "save_dots", "dots_saveable", "dots_with_no_batch_dims_saveable")
# Where a sparse layer's tables live on a mesh: a placement's record (placements.py), or the one of them that moves
# the fewest bytes per step (auto: sparsetx/plan/step_cost.py, docs/expert_parallel.md).
TABLE_PLACEMENTS = ("auto", *PLACEMENTS)


def kernel_defaults() -> ml_collections.ConfigDict:
  """config.model.ffn.kernel: the gated gather's and grouped matmul's static knobs (kernels/options.KernelOptions
  takes its defaults from here)."""
  return ml_collections.ConfigDict(
    dict(
      # The one kernel knob, on every platform (kernels/registry.py): auto (a CPU: xla; a GPU or TPU: the autotune
      # table's fastest correct implementation, XLA's included, else registry.DEFAULT_ORDER) | reference (the
      # papers' form) | an implementation by name (xla, xla_row_order, triton, triton_row_order, triton_fused,
      # mosaic (sm_90+), tpu, tpu_row_order, tpu_fused; off its platform in interpret mode) | an ordered list
      # "triton,tpu" (each entry on its own platform only; a CPU runs xla where none is its own)
      implementation="auto",
      token_chunk=4,  # xla on CPU: tokens whose gathered rows exist at once (2-8 fastest); elsewhere all
      pair_chunk=2048,  # xla on CPU: sorted (token, slot) pairs added per table-gradient step; elsewhere all
      block_tokens=8,  # triton: tokens per program
      block_d=128,  # GPU kernels: d_model chunk (largest fitting divisor; triton: a power of two)
      stages=3,  # mosaic: gathered [64, block_d] tiles in flight
      row_sorted=True,  # xla on CPU: training walks (token, slot) pairs in table-row order (kernels/rows/xla_gather.py)
      segment_chunk=64,  # the kernels' table gradients: pairs per segment; a hot row is cut and combined (0: never)
      group_rows=128,  # moe: rows of one expert per grouped-matmul tile (a power of two >= 16; Mosaic GPU: >= 64)
    )
  )


def ffn_defaults() -> ml_collections.ConfigDict:
  """Feed-forward knobs; each layer type reads the ones it needs (paper defaults)."""
  return ml_collections.ConfigDict(
    dict(
      type="sgatlin",
      d_ffw=28**2,  # neurons (sgatlin, peer: a square), hidden width (mlp, swiglu, moe expert)
      # sgatlin / peer
      n_channels=16,
      top_k=8,
      d_key=128,
      activation="identity",  # sgatlin ablation: relu | gelu | swish on the gated pre-activation g * <w_in, z>
      # GELU form (peer, fff, sgatlin's gelu ablation): None = each layer's official code (peer, sgatlin:
      # tanh approximation, jax.nn.gelu's default; fff: exact erf); True = tanh; False = exact erf.
      # A config saved before this field reads None. models/ffn/common.py: OFFICIAL_GELU_APPROXIMATE.
      gelu_approximate=ml_collections.config_dict.placeholder(bool),
      router="product",  # sgatlin: product (shared query) | peer (per-channel query, softmax)
      # moe (GPT-OSS style)
      n_experts=16,
      experts_per_token=2,
      aux_loss=0.0,  # Switch load-balancing loss weight (N * sum_i f_i P_i); 0 = off (the paper's baseline)
      router_z_loss=0.0,  # ST-MoE router z-loss weight (mean logsumexp(router logits)**2); 0 = off
      # Loss-free balancing (moe; sgatlin and peer per sub-key): a bias on the routing scores for the choice only,
      # moved by this much after each step against the step's load (models/ffn/selection_bias.py); 0 = off
      bias_update_rate=0.0,
      n_shared_experts=0,  # moe: dense SwiGLU experts of d_ffw every token passes through (DeepSeek); 0 = none
      router_scores="softmax",  # moe: softmax (over the k picked logits) | sigmoid (normalized over the k picked)
      # fff
      depth=6,
      n_trees=4,
      variant="fff",
      implementation="sparse",
      # sparse types on a mesh: auto | expert | fsdp | data (TABLE_PLACEMENTS above; dense types ignore it)
      placement="auto",
      # gated gather (sgatlin, peer, fff sparse) and moe's grouped matmul: backend and block sizes
      kernel=kernel_defaults(),
    )
  )


def model_defaults() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
    dict(
      vocab_size=512,
      d_model=256,
      n_layers=4,
      head_dim=64,
      max_len=256,  # context window; also the T of the ladder's attention FLOPs
      block="sequential",  # sequential pre-norm | parallel (GPT-NeoX / Pythia)
      norm="rmsnorm",
      norm_eps=1e-6,
      use_bias=False,  # biases on attention and dense feed-forward projections (Pythia: True)
      rotary_fraction=1.0,
      rope_base=10_000.0,
      tie_embeddings=False,
      init_std=0.02,  # embeddings and dense projections
      dtype="bfloat16",  # compute; softmax and logits are always float32
      # The LM head's dot on float32 operands (True), or on the compute dtype's with float32 sums (False: what
      # MaxText's logits_dot_in_fp32=False runs; half the bytes and twice the GPU rate, operands rounded to bf16).
      logits_dot_in_fp32=True,
      param_dtype="float32",
      # auto: cudnn on GPU (xla in float32), splash on TPU, xla on CPU | xla | cudnn | splash | pallas
      attention="auto",
      remat="none",  # none | full | dots_saveable | dots_with_no_batch_dims_saveable (saved True/False: full/none)
      # Runs of consecutive like layers as one lax.scan (parameters stay per layer: models/transformer.py
      # scan_blocks). Off by default: the step holds a stacked copy of the layers' parameters and gradients (peak
      # memory up) and XLA's cost analysis counts a loop body once (docs/measurements.md, issue 63).
      scan_layers=False,
      ffn=ffn_defaults(),
      # Mixed layers (sparse fine-tuning of some layers, sparsetx/tools/sparsify.py): the listed layer indices ("1,3")
      # use `ffn`, the others `dense_ffn`; "" = every layer uses `ffn` (and `dense_ffn` is unused). A string,
      # so the config saved as JSON compares equal on resume.
      ffn_layers="",
      dense_ffn=dense_ffn_defaults(),
    )
  )


def dense_ffn_defaults() -> ml_collections.ConfigDict:
  """The feed-forward layer kept by the layers outside config.model.ffn_layers (a dense MLP by default)."""
  ffn = ffn_defaults()
  ffn.type = "mlp"
  return ffn


def listed_ffn_layers(model, prefix: str = "config.model") -> tuple[int, ...]:
  """The layer indices of `ffn_layers` ("1,3" -> (1, 3)); () when empty or absent (configs saved before it)."""
  text = model.get("ffn_layers", "") or ""
  _require(isinstance(text, str), f"{prefix}.ffn_layers={text!r} must be a string of layer indices such as '1,3'.")
  try:
    return tuple(int(part) for part in text.replace(" ", "").split(",") if part)
  except ValueError:
    raise ConfigError(
      f"{prefix}.ffn_layers={text!r} is not a comma-separated list of layer indices; write e.g. '1,3' "
      "(empty = every layer)."
    ) from None


def is_mixed(model) -> bool:
  """True when some layers keep `dense_ffn` (ffn_layers lists a strict subset of the layers)."""
  return len(ffn_layer_indices(model)) < model.n_layers


def ffn_layer_indices(model) -> tuple[int, ...]:
  """Indices of the blocks whose feed-forward layer is `config.model.ffn` (every block when ffn_layers is empty)."""
  return tuple(sorted(set(listed_ffn_layers(model)))) or tuple(range(model.n_layers))


def layer_ffn_config(model, layer: int):
  """The feed-forward sub-config of block `layer`: `ffn`, or `dense_ffn` outside a non-empty `ffn_layers`."""
  return model.ffn if layer in ffn_layer_indices(model) else model.dense_ffn


DATA_EMBEDDED_TASKS = ("stories", "facts")  # generated by sparsetx.data.corpus; need no files
DATA_SOURCE_KINDS = ("text", "jsonl", "tfrecord", "tfds", "parquet", "datasets")
DATA_VOCAB_KINDS = ("byte", "sentencepiece", "gpt2")
BYTE_VOCAB_SIZE = 259  # seqio.ByteVocabulary: 256 bytes after pad=0, eos=1, unk=2


def source_patterns(value) -> tuple:
  """The file patterns of a source's `train` / `validation`: a path, a glob or a tuple of them (None: none)."""
  return (value,) if isinstance(value, str) else tuple(value or ())


def data_defaults() -> ml_collections.ConfigDict:
  """Input pipeline knobs (sparsetx/data): which tasks, how they mix, how text becomes batches.

  `sources` maps a task name to a local source, e.g.
  ``config.data.sources.web = ml_collections.ConfigDict(dict(kind="jsonl",
  train="/data/web/train-*.jsonl", validation="/data/web/val.jsonl", text_field="text"))``;
  kinds: text (one document per line), jsonl (a string field per line; files ending in .gz or .zst are
  decompressed), tfrecord (tf.train.Example with a bytes feature `text_field`), tfds (a prepared TFDS dataset:
  `tfds_name`, `data_dir`, split names in train/validation; nothing is downloaded), parquet (the string column
  `text_field`, by row group), datasets (a folder written by `datasets`' save_to_disk, one per split). `stories`
  and `facts` are built in. Training reads a tokenized corpus: `tokenized_dir`, or the sources tokenized into
  <workdir>/tokenized before the first step (and reused after).
  """
  return ml_collections.ConfigDict(
    dict(
      mixture=(("stories", 0.7), ("facts", 0.3)),  # (task, rate): rates are relative weights
      sources=ml_collections.ConfigDict(),
      # byte | sentencepiece (path: a .model file) | gpt2 (path: a directory with vocab.json + merges.txt,
      # or a tokenizer.json; GPT-2 byte-level BPE read locally, see sparsetx/data/bpe_vocab.py)
      vocab=dict(kind="byte", path=""),
      seq_len=256,  # tokens per packed row; at most config.model.max_len
      global_batch_size=16,  # rows per step over all processes
      eval_batch_size=16,  # rows per eval step over all processes
      seed=0,  # shuffling and mixture sampling; the same seed gives the same stream
      shuffle_buffer=1024,  # examples per task held for shuffling by the seqio tasks registered for other tools
      pack=True,  # pack documents into rows with segment ids and positions
      # A corpus written by sparsetx-tokenize (local or gs://); "": the trainer tokenizes the mixture's sources
      # into <workdir>/tokenized first. The batch of step s is a pure function of (this data config, seed, s).
      tokenized_dir="",
      # On resume, continue with this config's stream at the restored step even if the saved data fingerprint
      # (config and shards) differs; False refuses a changed stream.
      accept_new_stream=False,
      # Training refuses tokenized_dir="" (pod-scale configs: configs/ladder.py rungs on a target); a dry run
      # needs no data.
      require_tokenized=False,
      # Batches never trained on: "START:END,..." (inclusive, 1-based) names the batches that would train steps
      # START to END of a run that skips nothing; the steps go on with the batches after them. The windows a
      # rollback recorded in <workdir>/skipped_data.json are added. "": none.
      skip_steps="",
    )
  )


MESH_AXES = ("data", "fsdp", "tensor", "expert")
SCHEDULES = ("wsd", "cosine")
BAD_STEP_MODES = ("stop", "skip", "rollback")
WANDB_MODES = ("", "online", "offline", "disabled")  # "": online when a project is named, else off

# Logical axis names on parameters and activations -> mesh axes. Flax assigns each mesh axis at
# most once per array, so `embed` is fsdp-sharded on weights but not on activations whose batch
# already took fsdp. Expert parallelism: sgatlin/PEER channels, FFF trees and MoE experts.
DEFAULT_RULES = (
  ("batch", ("data", "fsdp", "expert")),
  ("length", None),
  ("embed", "fsdp"),
  ("vocab", "tensor"),
  ("heads", "tensor"),
  ("kv", None),
  ("mlp", "tensor"),
  ("channel", "expert"),
  ("neuron", None),
  ("key", None),
  ("tree", "expert"),
  ("node", None),
  ("expert", "expert"),
)


def rule_axes(rules, logical_name: str) -> tuple:
  """The mesh axes a logical axis name maps to under flax-style `rules` (the first rule naming it; () if none)."""
  axes = next((axes for name, axes in rules if name == logical_name), None)
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def train_defaults() -> ml_collections.ConfigDict:
  """Optimizer and loop knobs; defaults are the sgatlin paper's (AdamW, WSD, clip 1.0, wd 0.1)."""
  return ml_collections.ConfigDict(
    dict(
      steps=1000,
      learning_rate=1e-3,
      schedule="wsd",  # wsd: linear warmup, constant, 1 - sqrt decay over decay_fraction | cosine
      warmup_steps=100,
      decay_fraction=0.2,
      weight_decay=0.1,  # never on scalars
      decay_norms_and_biases=False,
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      clip_norm=1.0,
      microbatches=1,  # gradient accumulation: the global batch is split into this many
      z_loss=0.0,  # coefficient of log(Z)**2, 0 disables
      # The LM head and loss run over this many vocabulary tiles (train/loss.py chunked_token_losses), so only
      # one tile's float32 [B, T, vocab/n] logits exist at a time; the backward recomputes them. A fixed count
      # keeps the device loop at n trips whatever the tokens. 0 or 1: the whole [B, T, vocab] logits at once.
      loss_chunks=8,
      seed=0,
      log_every=10,
      eval_every=100,
      eval_batches=0,  # per validation task; 0 = the whole split
      # Sparse fine-tuning: for the first N steps only the feed-forward layers of config.model.ffn_layers
      # (every layer's when empty) train; everything else (copied by sparsetx/tools/sparsify.py) has learning rate 0.
      freeze_steps=0,
      # A resume whose schedule (steps, schedule, learning_rate, warmup_steps, decay_fraction) differs from the
      # checkpoint's is refused, naming the change, unless this is True (train/run/restore.py check_schedule).
      accept_schedule_change=False,
      # "START,COUNT": a jax.profiler trace of COUNT steps from step START, under <workdir>/tensorboard
      # (TensorBoard's profile tab); "" = none. Process 0 only unless profile_all_processes.
      profile_steps="",
      profile_all_processes=False,
      # On a GPU or TPU under kernel implementation=auto: before the step compiles, measure the kernel calls of the
      # step that the autotune table (kernels/autotune_table.py) lacks and keep the fastest correct implementation
      # (the trainer then starts JAX with XLA_PYTHON_CLIENT_PREALLOCATE=false, unless set: the candidates' child
      # processes need the memory). One process only; a multi-host run reads the table as found (fill it with
      # sparsetx-autotune). False: the table is neither read nor written, and `auto` takes the default order.
      autotune=True,
      # The seconds the trainer may spend measuring kernels before its first step; the calls left are not measured
      # (one line names them) and `auto` takes the default order for them. 0: measure nothing at start-up.
      autotune_budget_s=600.0,
      # What a bad step does (sparsetx/train/bad_steps.py, README "Bad steps"): stop | skip | rollback.
      #   stop: every update is applied; a non-finite loss, gradient norm or parameter norm ends the run (exit 3).
      #   skip: an update whose loss or gradient norm is non-finite, or spikes (above the mean + spike_sigmas
      #     standard deviations of the last spike_window accepted steps), is not applied; the step counter, the
      #     schedule's step and the data stream go on. max_bad_in_row skipped steps in a row, more than
      #     max_skipped_share of the last skipped_share_window steps, or a non-finite parameter norm end the run
      #     (exit 3), naming the steps and the fix.
      #   rollback: skip, and after max_bad_in_row skipped steps in a row (or on a non-finite parameter norm)
      #     restore the newest checkpoint whose parameters are those before them (one saved inside the row
      #     included) and step over their data (recorded in the workdir); the skipped share ends it as under skip.
      # Default stop: a short or comparative run (the ladder, a sweep) must show a spike, not step over it; long
      # runs (configs/large.py) take skip.
      bad_steps="stop",
      spike_sigmas=6.0,  # skip / rollback: a spike lies more than this many standard deviations above the mean
      spike_window=100,  # accepted steps whose loss and gradient norm the mean and deviation are taken over
      # skip / rollback: this many skipped steps in a row end the run (skip) or roll back (rollback). Five: a 6-sigma
      # spike recurring five times running is no spike; the run has diverged or its data went bad.
      max_bad_in_row=5,
      # skip / rollback: the run ends when more than this share of the last skipped_share_window steps it read were
      # skipped (judged once that many were read). 10 of 200: a healthy run skips at a 6-sigma rate, PaLM's 540B
      # run about 20 spikes in its whole run; skips this often are instability, and already 5% of the compute.
      max_skipped_share=0.05,
      skipped_share_window=200,
      max_rollbacks=3,  # rollback: rollbacks recorded in one workdir before the run stops (exit 3)
      # The hang watchdog (sparsetx/train/run/watchdog.py): when nothing finishes (a step, an evaluation batch, a
      # save call) within its limit, every process writes its threads' stacks and one error line and exits with
      # code 6, which the deploy/ recipes restart on. step_timeout_s: steps and data reads; None: derived,
      # max(300 s, 20 x the slowest of the last 100 steps), armed once the first step is done; 0: the watchdog off.
      step_timeout_s=ml_collections.config_dict.placeholder(float),
      # What is slow on purpose has its own limit, None: derived, max(1,800 s, 4 x the slowest of its kind measured
      # in the run). compile: the first train step and the first evaluation; save: a save call (it waits for the
      # previous save), the waits for a save (the last one, a rollback's, the close); restore: the start (the
      # checkpoint's checks and restore, or a fresh state's init) and a rollback's restore.
      compile_timeout_s=ml_collections.config_dict.placeholder(float),
      save_timeout_s=ml_collections.config_dict.placeholder(float),
      restore_timeout_s=ml_collections.config_dict.placeholder(float),
      # JAX's persistent compilation cache (sparsetx/train/run/compile_cache.py): a restart reads the compiled step.
      # "" = <workdir>/compilation_cache (gs:// works); JAX_COMPILATION_CACHE_DIR in the environment wins.
      compilation_cache=True,
      compilation_cache_dir="",
      # The sparse layers' usage over a window of steps (sparsetx/train/tracking/usage_window.py, README "Sparse layers'
      # health"): counts summed on the device, logged as usage/layers_i/* and reset every this many steps (a
      # multiple of log_every, at most the run). None: 10 x log_every, at most the run.
      usage_window=ml_collections.config_dict.placeholder(int),
    )
  )


def checkpoint_defaults() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
    dict(
      every=100,  # steps between checkpoints; one is always written at the end
      keep=3,  # the newest K are kept
      keep_period=0,  # also keep every step divisible by this permanently; 0 = none
      async_save=True,
      # Also save when this many minutes passed since the last save (all processes agree on the step, as on
      # SIGTERM, within about 5 s); 0: by step count only. Levanter's default: 15.
      every_minutes=15.0,
      # Resume from this saved step instead of the newest (e.g. when the newest is damaged); the steps after
      # it are moved to <workdir>/superseded/ (nothing is deleted). None: the newest.
      restore_step=ml_collections.config_dict.placeholder(int),
    )
  )


def mesh_defaults() -> ml_collections.ConfigDict:
  """Mesh axis sizes within a slice (ici) and across slices (dcn); one -1 per group is inferred."""
  return ml_collections.ConfigDict(
    dict(
      ici=dict(data=-1, fsdp=1, tensor=1, expert=1),
      dcn=dict(data=-1, fsdp=1, tensor=1, expert=1),  # -1: one data replica per slice / host
      rules=DEFAULT_RULES,
      # Refuse a parameter larger than this that ends up fully replicated on a multi-device mesh.
      max_replicated_mib=64.0,
      # The machine the config is sized for (plan/targets.py: h100x8, v5p-64, ...; set by configs/ladder.py's
      # TARGET); the dry run compiles for its topology. "": none.
      target="",
    )
  )


def metrics_defaults() -> ml_collections.ConfigDict:
  """Where metrics go besides metrics.jsonl and TensorBoard (both always written)."""
  return ml_collections.ConfigDict(
    dict(
      # Weights & Biases (sparsetx/train/tracking/wandb_writer.py; `pip install 'sparsetx[wandb]'`), from process 0. mode: ""
      # (online when a project is named, else off) | online | offline (`wandb sync` later) | disabled.
      wandb=dict(project="", entity="", name="", mode=""),
    )
  )


def wandb_on(metrics) -> bool:
  """Whether config.metrics.wandb logs: mode online or offline, or mode "" with a project named (configs saved
  before the section: off)."""
  wandb = (metrics or {}).get("wandb") or {}
  mode = wandb.get("mode", "")
  return mode in ("online", "offline") or (mode == "" and bool(wandb.get("project")))


def default_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = model_defaults()
  config.data = data_defaults()
  config.train = train_defaults()
  config.checkpoint = checkpoint_defaults()
  config.mesh = mesh_defaults()
  config.metrics = metrics_defaults()
  return config


def loss_chunk_count(vocab_size: int, loss_chunks: int) -> int:
  """How many vocabulary tiles the chunked loss runs: loss_chunks, at most one per vocabulary entry (0 or 1:
  unchunked). A constant, so the device loop has the same trips at any number of tokens."""
  return max(1, min(loss_chunks, vocab_size))


def remat_policy(model, prefix: str = "config.model") -> str:
  """The remat policy name of `model.remat`; configs saved before the policies hold True (full) or False (none)."""
  remat = model.get("remat", "none")
  if isinstance(remat, bool):
    return "full" if remat else "none"
  _require(
    remat in REMAT_POLICIES,
    f"{prefix}.remat={remat!r} is unknown; use one of {', '.join(map(repr, REMAT_POLICIES))}.",
  )
  return remat


def profile_steps(train: ml_collections.ConfigDict) -> tuple[int, int] | None:
  """(START, COUNT) of config.train.profile_steps="START,COUNT", or None when it is empty."""
  value = train.get("profile_steps", "")
  if value in ("", None):
    return None
  text = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
  parts = text.replace(" ", "").split(",")
  ok = len(parts) == 2 and all(p.isdigit() for p in parts) and int(parts[0]) >= 1 and int(parts[1]) >= 1
  _require(
    ok,
    f"config.train.profile_steps={value!r} must be 'START,COUNT' with START >= 1 and COUNT >= 1 (e.g. '10,5' "
    "traces steps 10 to 14), or '' for no profile.",
  )
  return int(parts[0]), int(parts[1])


def skip_step_windows(data: ml_collections.ConfigDict) -> tuple[tuple[int, int], ...]:
  """The (START, END) windows of config.data.skip_steps="START:END,..." (inclusive, 1-based), in order; () when
  empty or absent (configs saved before the field)."""
  value = data.get("skip_steps", "") or ""
  text = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
  windows = []
  for part in text.replace(" ", "").split(","):
    if not part:
      continue
    bounds = part.split(":")
    _require(
      len(bounds) == 2 and all(b.isdigit() for b in bounds),
      f"config.data.skip_steps={value!r}: {part!r} is not a window 'START:END' of step numbers; write e.g. "
      "'1200:1250,3000:3010' (inclusive), or '' for none.",
    )
    start, end = map(int, bounds)
    _require(start >= 1 and start <= end, f"config.data.skip_steps={value!r}: window {part!r} needs 1 <= START <= END.")
    _require(
      not windows or start > windows[-1][1],
      f"config.data.skip_steps={value!r}: window {part!r} starts at or before the end of the one before it; list "
      "the windows in order, without overlaps.",
    )
    windows.append((start, end))
  return tuple(windows)

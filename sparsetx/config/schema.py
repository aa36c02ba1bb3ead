"""The config schema: every knob with its default, and validation with one clear error per mistake.

Configs are `ml_collections.ConfigDict`s; the files under `configs/` start from `default_config()`
and override fields. `validate()` is called before anything is built, so a bad value is reported
by its dotted name (``config.model.ffn.top_k``) with the fix, instead of failing deep inside jit.
"""

import glob
import math
import os

import ml_collections

FFN_TYPES = ("mlp", "swiglu", "moe", "peer", "sgatlin", "fff")
BLOCK_KINDS = ("sequential", "parallel")
NORM_KINDS = ("rmsnorm", "layernorm")
SGATLIN_ACTIVATIONS = ("identity", "relu", "gelu", "swish")
SGATLIN_ROUTERS = ("product", "peer")
FFF_VARIANTS = ("fff", "fff_post")
FFF_IMPLEMENTATIONS = ("sparse", "masked_dense")
KERNEL_IMPLEMENTATIONS = ("xla", "pallas", "auto")  # gated gather: see sparsetx/kernels/gated_gather.py
GPU_KERNELS = ("mosaic", "triton", "auto")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash", "pallas")  # see sparsetx/models/attention.py
# Rematerialization per block: none, full (recompute everything), or a jax.checkpoint_policies name (what is saved).
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")


class ConfigError(ValueError):
  """A config value is wrong; the message names the field and how to fix it."""


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
          # fff
          depth=6,
          n_trees=4,
          variant="fff",
          implementation="sparse",
          # gated gather (sgatlin, peer, fff sparse): backend and block sizes
          kernel=ml_collections.ConfigDict(
              dict(
                  implementation="auto",  # xla | pallas | auto (pallas on GPU/TPU, xla on CPU)
                  token_chunk=4,  # xla: tokens whose gathered rows exist at once (2-8 fastest on CPU)
                  pair_chunk=2048,  # table gradients: sorted (token, slot) pairs added per step
                  block_tokens=8,  # pallas (triton): tokens per program
                  block_d=128,  # pallas (mosaic gpu): d_model chunk per gathered row copy (largest fitting divisor)
                  stages=3,  # pallas (mosaic gpu): gathered [64, block_d] tiles in flight
                  gpu_kernel="auto",  # pallas on GPU: mosaic | triton | auto (mosaic on sm_90+, triton before)
                  row_sorted=True,  # xla on CPU: training walks (token, slot) pairs in table-row order (kernels/xla_gather.py)
              )
          ),
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
          param_dtype="float32",
          # auto: cudnn on GPU (xla in float32), splash on TPU, xla on CPU | xla | cudnn | splash | pallas
          attention="auto",
          remat="none",  # none | full | dots_saveable | dots_with_no_batch_dims_saveable (saved True/False: full/none)
          ffn=ffn_defaults(),
          # Mixed layers (sparse fine-tuning of some layers, tools/sparsify.py): the listed layer indices ("1,3")
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
DATA_SOURCE_KINDS = ("text", "jsonl", "tfrecord", "tfds")
DATA_VOCAB_KINDS = ("byte", "sentencepiece", "gpt2")
BYTE_VOCAB_SIZE = 259  # seqio.ByteVocabulary: 256 bytes after pad=0, eos=1, unk=2


def data_defaults() -> ml_collections.ConfigDict:
  """Input pipeline knobs (sparsetx/data): which tasks, how they mix, how text becomes batches.

  `sources` maps a task name to a local source, e.g.
  ``config.data.sources.web = ml_collections.ConfigDict(dict(kind="jsonl",
  train="/data/web/train-*.jsonl", validation="/data/web/val.jsonl", text_field="text"))``;
  kinds: text (one document per line), jsonl (a string field per line), tfrecord (tf.train.Example
  with a bytes feature `text_field`), tfds (a prepared TFDS dataset: `tfds_name`, `data_dir`,
  split names in train/validation; nothing is downloaded). `stories` and `facts` are built in.
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
          shuffle_buffer=1024,  # examples per task held for shuffling (also sets resume-state size)
          pack=True,  # pack documents into rows with segment ids and positions
      )
  )


MESH_AXES = ("data", "fsdp", "tensor", "expert")
SCHEDULES = ("wsd", "cosine")

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
          seed=0,
          log_every=10,
          eval_every=100,
          eval_batches=0,  # per validation task; 0 = the whole split
          # Sparse fine-tuning: for the first N steps only the feed-forward layers of config.model.ffn_layers
          # (every layer's when empty) train; everything else (copied by tools/sparsify.py) has learning rate 0.
          freeze_steps=0,
          # "START,COUNT": a jax.profiler trace of COUNT steps from step START, under <workdir>/tensorboard
          # (TensorBoard's profile tab); "" = none. Process 0 only unless profile_all_processes.
          profile_steps="",
          profile_all_processes=False,
      )
  )


def checkpoint_defaults() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
      dict(
          every=100,  # steps between checkpoints; one is always written at the end
          keep=3,  # the newest K are kept
          keep_period=0,  # also keep every step divisible by this permanently; 0 = none
          async_save=True,
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
      )
  )


def default_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = model_defaults()
  config.data = data_defaults()
  config.train = train_defaults()
  config.checkpoint = checkpoint_defaults()
  config.mesh = mesh_defaults()
  return config


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def _one_of(name: str, value, choices) -> None:
  _require(value in choices, f"{name}={value!r} is unknown; use one of {', '.join(map(repr, choices))}.")


def _positive_int(name: str, value) -> None:
  _require(isinstance(value, int) and value > 0, f"{name}={value!r} must be a positive integer.")


def n_keys_for(d_ffw: int, field: str = "config.model.ffn.d_ffw") -> int:
  """sqrt(d_ffw) for a product-key layer, refusing a d_ffw that is not a perfect square."""
  n_keys = math.isqrt(d_ffw) if isinstance(d_ffw, int) and d_ffw > 0 else 0
  _require(
      n_keys * n_keys == d_ffw and n_keys > 0,
      f"{field}={d_ffw!r} must be a perfect square (product keys index n_keys**2 neurons); "
      f"use e.g. {max(1, round(math.sqrt(max(d_ffw, 1)))) ** 2}.",
  )
  return n_keys


def validate_ffn(ffn: ml_collections.ConfigDict, d_model: int, prefix: str = "config.model.ffn") -> None:
  _one_of(f"{prefix}.type", ffn.type, FFN_TYPES)
  kind = ffn.type
  if kind in ("mlp", "swiglu", "moe"):
    _positive_int(f"{prefix}.d_ffw", ffn.d_ffw)
  if kind == "moe":
    _positive_int(f"{prefix}.n_experts", ffn.n_experts)
    _positive_int(f"{prefix}.experts_per_token", ffn.experts_per_token)
    _require(
        ffn.experts_per_token <= ffn.n_experts,
        f"{prefix}.experts_per_token={ffn.experts_per_token} exceeds {prefix}.n_experts={ffn.n_experts}; "
        "route each token to at most n_experts experts.",
    )
    for field in ("aux_loss", "router_z_loss"):
      value = ffn.get(field, 0.0)
      _require(
          isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0,
          f"{prefix}.{field}={value!r} must be a finite number >= 0 (0 turns it off).",
      )
  if kind in ("peer", "sgatlin"):
    n_keys = n_keys_for(ffn.d_ffw, f"{prefix}.d_ffw")
    _positive_int(f"{prefix}.n_channels", ffn.n_channels)
    _positive_int(f"{prefix}.top_k", ffn.top_k)
    _positive_int(f"{prefix}.d_key", ffn.d_key)
    _require(
        ffn.top_k < n_keys,
        f"{prefix}.top_k={ffn.top_k} must be smaller than sqrt(d_ffw)={n_keys}; "
        "lower top_k or raise d_ffw.",
    )
    uses_peer_router = kind == "peer" or ffn.router == "peer"
    _require(
        not uses_peer_router or ffn.d_key % 2 == 0,
        f"{prefix}.d_key={ffn.d_key} must be even for the PEER router (the query is split in two halves).",
    )
  if kind in ("peer", "sgatlin", "fff"):
    choice = ffn.get("gelu_approximate", None)
    _require(
        choice is None or isinstance(choice, bool),
        f"{prefix}.gelu_approximate={choice!r} must be None (the layer's official form), True (tanh) or "
        "False (exact erf).",
    )
  if kind == "sgatlin":
    _one_of(f"{prefix}.activation", ffn.activation, SGATLIN_ACTIVATIONS)
    _one_of(f"{prefix}.router", ffn.router, SGATLIN_ROUTERS)
  if kind == "fff":
    _require(
        isinstance(ffn.depth, int) and ffn.depth >= 0,
        f"{prefix}.depth={ffn.depth!r} must be an integer >= 0 (0 is a single node per tree).",
    )
    _positive_int(f"{prefix}.n_trees", ffn.n_trees)
    _one_of(f"{prefix}.variant", ffn.variant, FFF_VARIANTS)
    _one_of(f"{prefix}.implementation", ffn.implementation, FFF_IMPLEMENTATIONS)
  if kind in ("peer", "sgatlin", "fff"):
    _one_of(f"{prefix}.kernel.implementation", ffn.kernel.implementation, KERNEL_IMPLEMENTATIONS)
    for field in ("token_chunk", "pair_chunk", "block_tokens", "block_d", "stages"):
      _positive_int(f"{prefix}.kernel.{field}", ffn.kernel[field])
    _one_of(f"{prefix}.kernel.gpu_kernel", ffn.kernel.gpu_kernel, GPU_KERNELS)


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


def validate_attention(model, prefix: str = "config.model") -> None:
  attention = model.get("attention", "auto")  # configs saved before the field: auto
  _one_of(f"{prefix}.attention", attention, ATTENTION_IMPLEMENTATIONS)
  if attention == "cudnn":
    _require(
        model.dtype in ("bfloat16", "float16"),
        f"{prefix}.attention='cudnn' has no {model.dtype} kernel; set {prefix}.dtype to 'bfloat16' or 'float16', "
        "or use attention='auto' (xla in float32).",
    )
    _require(
        model.head_dim % 8 == 0 and model.head_dim <= 256,
        f"{prefix}.attention='cudnn' needs a head_dim that is a multiple of 8 and at most 256 (128 before Hopper), "
        f"not {model.head_dim}; change {prefix}.head_dim or use attention='xla'.",
    )


def validate_model(model: ml_collections.ConfigDict, prefix: str = "config.model") -> None:
  for field in ("vocab_size", "d_model", "n_layers", "head_dim", "max_len"):
    _positive_int(f"{prefix}.{field}", model[field])
  _require(
      model.d_model % model.head_dim == 0,
      f"{prefix}.d_model={model.d_model} is not divisible by {prefix}.head_dim={model.head_dim}; "
      "choose d_model as a multiple of head_dim.",
  )
  _one_of(f"{prefix}.block", model.block, BLOCK_KINDS)
  _one_of(f"{prefix}.norm", model.norm, NORM_KINDS)
  validate_attention(model, prefix)
  remat_policy(model, prefix)
  _one_of(f"{prefix}.dtype", model.dtype, DTYPES)
  _one_of(f"{prefix}.param_dtype", model.param_dtype, DTYPES)
  _require(
      0.0 <= model.rotary_fraction <= 1.0,
      f"{prefix}.rotary_fraction={model.rotary_fraction} must lie in [0, 1].",
  )
  rotary_dims = int(model.head_dim * model.rotary_fraction)
  _require(
      rotary_dims % 2 == 0,
      f"{prefix}.rotary_fraction={model.rotary_fraction} gives {rotary_dims} rotary dims of "
      f"head_dim={model.head_dim}; rotary dims must be even.",
  )
  validate_ffn(model.ffn, model.d_model, f"{prefix}.ffn")
  layers = listed_ffn_layers(model, prefix)
  for i in layers:
    _require(
        0 <= i < model.n_layers,
        f"{prefix}.ffn_layers={model.ffn_layers!r} holds layer {i}, outside the {model.n_layers} layers "
        f"(0..{model.n_layers - 1}); remove it.",
    )
  _require(
      len(set(layers)) == len(layers), f"{prefix}.ffn_layers={model.ffn_layers!r} lists a layer twice; list each once."
  )
  if is_mixed(model):
    validate_ffn(model.dense_ffn, model.d_model, f"{prefix}.dense_ffn")


def _patterns(value) -> tuple:
  return (value,) if isinstance(value, str) else tuple(value or ())


def _check_files(field: str, patterns: tuple) -> None:
  """Each local pattern must match at least one file and no matched file may be empty."""
  for pattern in patterns:
    _require(isinstance(pattern, str) and pattern, f"{field}={patterns!r} holds an empty path; give a file path or glob.")
    if "://" in pattern:
      continue  # remote (gs://, s3://): checked by the pipeline when it lists the files
    files = sorted(glob.glob(os.path.expanduser(pattern)))
    _require(bool(files), f"{field}: no file matches {pattern!r}; check the path or create the file.")
    for path in files:
      _require(
          os.path.getsize(path) > 0,
          f"{field}: file {path!r} is empty; fill it or remove it from the pattern.",
      )


def validate_source(name: str, source: ml_collections.ConfigDict, prefix: str) -> None:
  kind = source.get("kind")
  _one_of(f"{prefix}.kind", kind, DATA_SOURCE_KINDS)
  _require(
      name not in DATA_EMBEDDED_TASKS,
      f"{prefix}: {name!r} is a built-in task of the embedded corpus; give your source another name.",
  )
  if kind == "tfds":
    _require(bool(source.get("tfds_name")), f"{prefix}.tfds_name is empty; give the TFDS name, e.g. 'my_corpus:1.0.0'.")
    data_dir = source.get("data_dir")
    _require(
        bool(data_dir) and ("://" in data_dir or os.path.isdir(data_dir)),
        f"{prefix}.data_dir={data_dir!r} is not a directory; point it at the prepared TFDS data "
        "(nothing is downloaded).",
    )
    _require(bool(source.get("train")), f"{prefix}.train is empty; give the TFDS split name, e.g. 'train'.")
  else:
    train = _patterns(source.get("train"))
    _require(bool(train), f"{prefix}.train is empty; give a file path or glob of training data.")
    _check_files(f"{prefix}.train", train)
    _check_files(f"{prefix}.validation", _patterns(source.get("validation")))
  if kind != "text":
    field = source.get("text_field", "text")
    _require(isinstance(field, str) and bool(field), f"{prefix}.text_field={field!r} must name the text field.")


def validate_data(data: ml_collections.ConfigDict, model: ml_collections.ConfigDict | None = None,
                  prefix: str = "config.data") -> None:
  """Checks config.data (and, given `model`, that data fits the model); one error per mistake."""
  for field in ("seq_len", "global_batch_size", "eval_batch_size", "shuffle_buffer"):
    _positive_int(f"{prefix}.{field}", data[field])
  _require(isinstance(data.seed, int), f"{prefix}.seed={data.seed!r} must be an integer.")
  _require(isinstance(data.pack, bool), f"{prefix}.pack={data.pack!r} must be True or False.")
  sources = data.sources or {}
  for name in sources:
    validate_source(name, sources[name], f"{prefix}.sources.{name}")
  known = tuple(DATA_EMBEDDED_TASKS) + tuple(sources)
  mixture = tuple(data.mixture or ())
  _require(bool(mixture), f"{prefix}.mixture is empty; give (task, rate) pairs, e.g. (('stories', 1.0),).")
  seen = set()
  for entry in mixture:
    _require(
        isinstance(entry, (tuple, list)) and len(entry) == 2,
        f"{prefix}.mixture entry {entry!r} must be a (task, rate) pair.",
    )
    name, rate = entry
    _require(
        name in known,
        f"{prefix}.mixture names unknown task {name!r}; use one of {', '.join(map(repr, known))} "
        f"or define it under {prefix}.sources.{name}.",
    )
    _require(name not in seen, f"{prefix}.mixture lists task {name!r} twice; give each task one rate.")
    seen.add(name)
    _require(
        isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate) and rate > 0,
        f"{prefix}.mixture rate for {name!r} is {rate!r}; use a positive number (rates are relative weights).",
    )
  _one_of(f"{prefix}.vocab.kind", data.vocab.kind, DATA_VOCAB_KINDS)
  if data.vocab.kind == "sentencepiece":
    path = data.vocab.path
    _require(
        bool(path) and ("://" in path or os.path.isfile(path)),
        f"{prefix}.vocab.path={path!r} is not a file; build one with tools/build_vocab.py.",
    )
  gpt2 = None
  if data.vocab.kind == "gpt2":
    from sparsetx.data import bpe_vocab  # tokenizers only, no TensorFlow; imported here so config stays light

    gpt2 = bpe_vocab.load(data.vocab.path, f"{prefix}.vocab.path")  # missing or bad files: one clear error
  if model is not None:
    _require(
        data.seq_len <= model.max_len,
        f"{prefix}.seq_len={data.seq_len} exceeds config.model.max_len={model.max_len}; "
        "lower seq_len or raise max_len.",
    )
    if data.vocab.kind == "byte":
      _require(
          BYTE_VOCAB_SIZE <= model.vocab_size,
          f"config.model.vocab_size={model.vocab_size} is smaller than the byte vocabulary of "
          f"{prefix}.vocab.kind='byte' ({BYTE_VOCAB_SIZE} ids); raise config.model.vocab_size.",
      )
    if gpt2 is not None:
      _require(
          gpt2.vocab_size <= model.vocab_size,
          f"config.model.vocab_size={model.vocab_size} is smaller than the GPT-2 BPE of {prefix}.vocab.path="
          f"{data.vocab.path!r} ({gpt2.vocab_size} ids); raise config.model.vocab_size (a multiple of 64 is "
          "fastest, e.g. 50304 for GPT-2's files).",
      )


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


def validate_train(train: ml_collections.ConfigDict, checkpoint: ml_collections.ConfigDict, global_batch_size: int) -> None:
  for field in ("steps", "microbatches", "log_every", "eval_every"):
    _positive_int(f"config.train.{field}", train[field])
  for field in ("warmup_steps", "eval_batches", "seed"):
    _require(isinstance(train[field], int) and train[field] >= 0, f"config.train.{field}={train[field]!r} must be an integer >= 0.")
  _require(
      isinstance(train.freeze_steps, int) and train.freeze_steps >= 0,
      f"config.train.freeze_steps={train.freeze_steps!r} must be an integer >= 0 (0 trains every parameter from step 0).",
  )
  _one_of("config.train.schedule", train.schedule, SCHEDULES)
  _require(train.learning_rate > 0, f"config.train.learning_rate={train.learning_rate!r} must be positive.")
  _require(0 <= train.decay_fraction <= 1, f"config.train.decay_fraction={train.decay_fraction!r} must lie in [0, 1].")
  _require(train.weight_decay >= 0, f"config.train.weight_decay={train.weight_decay!r} must be >= 0.")
  _require(train.clip_norm > 0, f"config.train.clip_norm={train.clip_norm!r} must be positive.")
  _require(train.z_loss >= 0, f"config.train.z_loss={train.z_loss!r} must be >= 0.")
  _require(
      global_batch_size % train.microbatches == 0,
      f"config.train.microbatches={train.microbatches} does not divide config.data.global_batch_size="
      f"{global_batch_size}; pick a divisor.",
  )
  profile_steps(train)
  _require(
      isinstance(train.get("profile_all_processes", False), bool),
      f"config.train.profile_all_processes={train.get('profile_all_processes')!r} must be True or False.",
  )
  _positive_int("config.checkpoint.every", checkpoint.every)
  _positive_int("config.checkpoint.keep", checkpoint.keep)
  _require(
      isinstance(checkpoint.keep_period, int) and checkpoint.keep_period >= 0,
      f"config.checkpoint.keep_period={checkpoint.keep_period!r} must be an integer >= 0 (0 keeps none permanently).",
  )
  restore_step = checkpoint.get("restore_step")
  _require(
      restore_step is None or (isinstance(restore_step, int) and restore_step >= 0),
      f"config.checkpoint.restore_step={restore_step!r} must be a saved step (an integer >= 0), or None for the newest.",
  )


def validate_mesh(mesh: ml_collections.ConfigDict) -> None:
  for group in ("ici", "dcn"):
    sizes = mesh[group]
    _require(
        set(sizes.keys()) == set(MESH_AXES),
        f"config.mesh.{group} has axes {sorted(sizes.keys())}; give exactly {', '.join(MESH_AXES)}.",
    )
    for axis in MESH_AXES:
      _require(
          isinstance(sizes[axis], int) and (sizes[axis] > 0 or sizes[axis] == -1),
          f"config.mesh.{group}.{axis}={sizes[axis]!r} must be a positive integer or -1 (inferred).",
      )
    _require(
        sum(sizes[axis] == -1 for axis in MESH_AXES) <= 1,
        f"config.mesh.{group} has more than one -1; at most one axis per group can be inferred.",
    )


def validate_finite(tree, prefix: str = "config") -> None:
  """Refuses inf and NaN anywhere: `--config.train.learning_rate=inf` parses as a float, and would only show
  up as a diverged run after compiling (NaN also passes every `x > 0` check as False, inf passes them)."""
  items = tree.items() if isinstance(tree, (dict, ml_collections.ConfigDict)) else enumerate(tree)
  for key, value in items:
    name = f"{prefix}.{key}" if isinstance(key, str) else f"{prefix}[{key}]"
    if isinstance(value, (dict, ml_collections.ConfigDict, tuple, list)):
      validate_finite(value, name)
    elif isinstance(value, float) and not math.isfinite(value):
      _require(False, f"{name}={value!r} is not a finite number; give a finite value.")


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks the whole config; returns it unchanged so callers can chain."""
  validate_finite(config)
  validate_model(config.model)
  validate_data(config.data, config.model)
  validate_train(config.train, config.checkpoint, config.data.global_batch_size)
  validate_mesh(config.mesh)
  return config

"""Cross-field checks of a whole config, run before anything is built; no file is opened here.

`validate(config)` reports the first mistake as one `ConfigError` naming the dotted field and the fix,
instead of a failure deep inside jit. Whether the data and tokenizer files exist is checked where they
are opened: `sparsetx.data.check_files(config)`.
"""

import importlib.util
import math

import ml_collections

from sparsetx.config.errors import one_of as _one_of
from sparsetx.config.errors import positive_int as _positive_int
from sparsetx.config.errors import require as _require
from sparsetx.config.ffn_checks import validate_ffn
from sparsetx.config.schema import (
  ATTENTION_IMPLEMENTATIONS,
  BAD_STEP_MODES,
  BLOCK_KINDS,
  BYTE_VOCAB_SIZE,
  DATA_EMBEDDED_TASKS,
  DATA_SOURCE_KINDS,
  DATA_VOCAB_KINDS,
  DTYPES,
  MESH_AXES,
  NORM_KINDS,
  SCHEDULES,
  WANDB_MODES,
  is_mixed,
  listed_ffn_layers,
  profile_steps,
  remat_policy,
  skip_step_windows,
  source_patterns,
  wandb_on,
)


def validate_attention(model, prefix: str = "config.model") -> None:
  attention = model.get("attention", "auto")  # configs saved before the field: auto
  _require(
    attention != "pallas",
    f"{prefix}.attention='pallas' is retired (JAX deprecated its Pallas GPU attention for tokamax's); use 'cudnn' "
    "on a GPU (what 'auto' takes there in bf16) or 'auto'.",
  )
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
    isinstance(model.get("logits_dot_in_fp32", True), bool),
    f"{prefix}.logits_dot_in_fp32={model.get('logits_dot_in_fp32')!r} must be True or False.",
  )
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
      bool(data_dir),
      f"{prefix}.data_dir={data_dir!r} is not a directory; point it at the prepared TFDS data (nothing is downloaded).",
    )
    _require(bool(source.get("train")), f"{prefix}.train is empty; give the TFDS split name, e.g. 'train'.")
  else:
    train = source_patterns(source.get("train"))  # each path or glob: sparsetx.data.check_files
    _require(bool(train), f"{prefix}.train is empty; give a file path or glob of training data.")
  if kind != "text":
    field = source.get("text_field", "text")
    _require(isinstance(field, str) and bool(field), f"{prefix}.text_field={field!r} must name the text field.")


def validate_data(
  data: ml_collections.ConfigDict, model: ml_collections.ConfigDict | None = None, prefix: str = "config.data"
) -> None:
  """Checks config.data (and, given `model`, that data fits the model); one error per mistake.

  The files it names (sources, vocabulary) are checked by sparsetx.data.check_files, where they are opened.
  """
  for field in ("seq_len", "global_batch_size", "eval_batch_size", "shuffle_buffer"):
    _positive_int(f"{prefix}.{field}", data[field])
  _require(isinstance(data.seed, int), f"{prefix}.seed={data.seed!r} must be an integer.")
  _require(isinstance(data.pack, bool), f"{prefix}.pack={data.pack!r} must be True or False.")
  _require(
    isinstance(data.tokenized_dir, str),
    f"{prefix}.tokenized_dir={data.tokenized_dir!r} must be a path (a corpus written by sparsetx-tokenize) or ''.",
  )
  _require(
    isinstance(data.accept_new_stream, bool), f"{prefix}.accept_new_stream={data.accept_new_stream!r} must be a bool."
  )
  _require(
    isinstance(data.require_tokenized, bool), f"{prefix}.require_tokenized={data.require_tokenized!r} must be a bool."
  )
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
    _require(
      bool(data.vocab.path),
      f"{prefix}.vocab.path={data.vocab.path!r} is not a file; build one with python -m sparsetx.tools.build_vocab.",
    )
  if model is not None:
    _require(
      data.seq_len <= model.max_len,
      f"{prefix}.seq_len={data.seq_len} exceeds config.model.max_len={model.max_len}; lower seq_len or raise max_len.",
    )
    if data.vocab.kind == "byte":
      _require(
        BYTE_VOCAB_SIZE <= model.vocab_size,
        f"config.model.vocab_size={model.vocab_size} is smaller than the byte vocabulary of "
        f"{prefix}.vocab.kind='byte' ({BYTE_VOCAB_SIZE} ids); raise config.model.vocab_size.",
      )


def validate_train(
  train: ml_collections.ConfigDict, checkpoint: ml_collections.ConfigDict, global_batch_size: int
) -> None:
  for field in ("steps", "microbatches", "log_every", "eval_every"):
    _positive_int(f"config.train.{field}", train[field])
  for field in ("warmup_steps", "eval_batches", "seed"):
    _require(
      isinstance(train[field], int) and train[field] >= 0,
      f"config.train.{field}={train[field]!r} must be an integer >= 0.",
    )
  _require(
    isinstance(train.freeze_steps, int) and train.freeze_steps >= 0,
    f"config.train.freeze_steps={train.freeze_steps!r} must be an integer >= 0 (0 trains every parameter from step 0).",
  )
  loss_chunks = train.get("loss_chunks", 0)  # configs saved before the knob existed: the whole logits
  _require(
    isinstance(loss_chunks, int) and loss_chunks >= 0,
    f"config.train.loss_chunks={loss_chunks!r} must be an integer >= 0 (0 or 1: the whole logits at once).",
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
  validate_bad_steps(train)
  window = train.get("usage_window")
  _require(
    window is None or (isinstance(window, int) and 0 < window <= train.steps and window % train.log_every == 0),
    f"config.train.usage_window={window!r} must be a multiple of config.train.log_every={train.log_every} in "
    f"[{train.log_every}, config.train.steps={train.steps}] (None: 10 log intervals).",
  )
  timeout = train.get("step_timeout_s")
  _require(
    timeout is None or (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout >= 0),
    f"config.train.step_timeout_s={timeout!r} must be seconds >= 0 (0: no watchdog), or None to derive it from "
    "the measured step times.",
  )
  budget = train.get("autotune_budget_s", 600.0)
  _require(
    isinstance(budget, (int, float)) and not isinstance(budget, bool) and math.isfinite(budget) and budget >= 0,
    f"config.train.autotune_budget_s={budget!r} must be seconds >= 0 (0: measure nothing at start-up; "
    "sparsetx-autotune fills the table).",
  )
  for kind in ("compile", "save", "restore"):
    timeout = train.get(f"{kind}_timeout_s")
    _require(
      timeout is None or (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0),
      f"config.train.{kind}_timeout_s={timeout!r} must be seconds > 0, or None to derive it from the measured "
      f"{kind} times (config.train.step_timeout_s=0 turns the watchdog off).",
    )
  minutes = checkpoint.get("every_minutes", 0.0)
  _require(
    isinstance(minutes, (int, float)) and not isinstance(minutes, bool) and minutes >= 0,
    f"config.checkpoint.every_minutes={minutes!r} must be minutes >= 0 (0: save by step count only).",
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


def validate_wandb(metrics) -> None:
  """config.metrics.wandb (configs saved before it: off): a known mode, a project wherever it is on, the package."""
  wandb = (metrics or {}).get("wandb") or {}
  for field in ("project", "entity", "name", "mode"):
    _require(
      isinstance(wandb.get(field, ""), str), f"config.metrics.wandb.{field}={wandb.get(field)!r} must be a string."
    )
  mode = wandb.get("mode", "")
  _one_of("config.metrics.wandb.mode", mode, WANDB_MODES)
  _require(
    mode not in ("online", "offline") or wandb.get("project"),
    f"config.metrics.wandb.mode={mode!r} needs a W&B project: give --config.metrics.wandb.project=NAME.",
  )
  _require(
    not wandb_on(metrics) or importlib.util.find_spec("wandb") is not None,
    f"config.metrics.wandb.project={wandb.get('project')!r} needs the wandb package, which is not installed: "
    "pip install 'sparsetx[wandb]' (or --config.metrics.wandb.mode=disabled).",
  )


def validate_bad_steps(train: ml_collections.ConfigDict) -> None:
  """config.train.bad_steps and its thresholds (configs saved before them: stop)."""
  _one_of("config.train.bad_steps", train.get("bad_steps", "stop"), BAD_STEP_MODES)
  sigmas = train.get("spike_sigmas", 6.0)
  _require(
    isinstance(sigmas, (int, float)) and not isinstance(sigmas, bool) and sigmas > 0,
    f"config.train.spike_sigmas={sigmas!r} must be a positive number of standard deviations (6 is Levanter's).",
  )
  for field in ("spike_window", "max_bad_in_row", "skipped_share_window"):
    _positive_int(f"config.train.{field}", train.get(field, 1))
  share = train.get("max_skipped_share", 0.05)
  _require(
    isinstance(share, (int, float)) and not isinstance(share, bool) and 0 <= share < 1,
    f"config.train.max_skipped_share={share!r} must be a fraction in [0, 1) of config.train.skipped_share_window.",
  )
  rollbacks = train.get("max_rollbacks", 0)
  _require(
    isinstance(rollbacks, int) and not isinstance(rollbacks, bool) and rollbacks >= 0,
    f"config.train.max_rollbacks={rollbacks!r} must be an integer >= 0.",
  )


def validate_skip_steps(data: ml_collections.ConfigDict, steps: int) -> None:
  """config.data.skip_steps: windows in order, each reached by a run of `steps` steps (the earlier windows push
  the later ones' batches back by their lengths)."""
  skipped = 0
  for start, end in skip_step_windows(data):
    _require(
      start <= steps + skipped,
      f"config.data.skip_steps={data.skip_steps!r}: window {start}:{end} lies outside the run, whose "
      f"{steps} steps (config.train.steps) read batches up to {steps + skipped}; drop it or train longer.",
    )
    skipped += end - start + 1


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
  validate_skip_steps(config.data, config.train.steps)
  validate_mesh(config.mesh)
  validate_wandb(config.get("metrics"))
  return config

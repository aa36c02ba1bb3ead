"""Test setup: 8 simulated CPU devices, float32 layer configs, and loading of config files."""

import atexit
import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import tempfile

# Everything the session and the programs it starts write to the temporary directory (TensorFlow's autograph
# files, the compilation cache) goes to one directory of this process, removed when it exits: nothing is left
# behind in /tmp.
_SESSION_TMP = tempfile.mkdtemp(prefix="sparsetx-tests-")
atexit.register(shutil.rmtree, _SESSION_TMP, ignore_errors=True)
os.environ["TMPDIR"] = tempfile.tempdir = _SESSION_TMP

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the session, shared with the trainer processes the tests start: the
# same small models are compiled by many tests.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_SESSION_TMP, "jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from sparsetx import torch_compat  # noqa: E402

torch_compat.keep_triton_out()  # tests run torch (export, lm-eval) in processes that have loaded TensorFlow

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from sparsetx import config as config_lib  # noqa: E402

# Implicit rank promotion (x_BTD + b_D broadcasting by adding leading axes) hides shape mistakes: every test
# runs with it as an error, so the code under test spells each broadcast out.
jax.config.update("jax_numpy_rank_promotion", "raise")

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_config(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """Loads configs/<file>.py like `--config=configs/<file>.py:<arg>` does."""
  spec = importlib.util.spec_from_file_location("config_under_test", REPO / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config() if arg is None else module.get_config(arg)


def layer_model_config(ffn_type: str, d_model: int = 32, **ffn) -> ml_collections.FrozenConfigDict:
  """A validated float32 model config for one feed-forward layer under test."""
  config = config_lib.default_config()
  config.model.update(d_model=d_model, head_dim=d_model, dtype="float32")
  config.model.ffn.type = ffn_type
  config.model.ffn.update(ffn)
  config_lib.validate(config)
  return ml_collections.FrozenConfigDict(config.model)


def init_params(module, *args, seed: int = 0):
  """Unboxed float params of `module` (logical-axis metadata removed)."""
  return nn.unbox(jax.jit(module.init)(jax.random.key(seed), *args))["params"]


def synthetic_batch(config, seed=0):
  """A global batch of random byte-level tokens for `config`, with half of row 0 packing padding (weight 0)."""
  rng = np.random.default_rng(seed)
  B, T = config.data.global_batch_size, config.data.seq_len
  tokens = rng.integers(1, 259, (B, T + 1)).astype(np.int32)
  weights = np.ones((B, T), np.float32)
  weights[0, T // 2 :] = 0.0
  return dict(
    inputs=tokens[:, :-1],
    targets=tokens[:, 1:],
    segment_ids=np.ones((B, T), np.int32),
    positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
    loss_weights=weights,
  )


# A two-layer sgatlin small enough for the dry-run program to build in seconds (configs/tiny.py:sgatlin overrides).
# Each sparse type at d_model 16 with 8 units (channels, trees, experts), so they split over 8 devices: the
# multi-device layer tests (expert parallelism, table placement).
SPARSE_LAYERS_OF_8 = {
  "sgatlin": dict(n_channels=8, d_ffw=36, top_k=2, d_key=8),
  "peer": dict(n_channels=8, d_ffw=36, top_k=2, d_key=8),
  "fff": dict(n_trees=8, depth=2),
  "moe": dict(n_experts=8, experts_per_token=2, d_ffw=8),
}

MICRO_SGATLIN_FLAGS = (
  "--config.model.d_model=32",
  "--config.model.n_layers=2",
  "--config.model.head_dim=32",
  "--config.model.max_len=16",
  "--config.model.ffn.n_channels=8",
  "--config.model.ffn.d_ffw=64",
  "--config.model.ffn.top_k=2",
  "--config.model.ffn.d_key=8",
  "--config.data.seq_len=16",
  "--config.data.global_batch_size=8",
  "--config.data.eval_batch_size=8",
)


def write_tokenized_corpus(directory, documents: dict, shards: int = 2) -> pathlib.Path:
  """A tokenized corpus of the embedded tasks (what sparsetx-tokenize writes for them): `documents` maps a task
  to {split: texts}, each text encoded with seqio's ByteVocabulary plus EOS, train split over `shards` shards."""
  import seqio

  from sparsetx.data import token_store

  vocabulary = seqio.ByteVocabulary()
  tasks = {}
  for task, splits in documents.items():
    tasks[task] = {}
    for split, texts in splits.items():
      encoded = [np.array(vocabulary.encode(text) + [vocabulary.eos_id], np.int32) for text in texts if text]
      count = shards if split == "train" else 1
      for i in range(count):
        path = token_store.split_dir(directory, task, split) / token_store.shard_name(i, count)
        token_store.write_shard(path, encoded[i::count], vocabulary.vocab_size)
      tasks[task][split] = count
  vocab_record = {"kind": "byte", "path": "", "vocab_size": vocabulary.vocab_size, "eos_id": vocabulary.eos_id}
  token_store.write_manifest(directory, vocab_record, tasks)
  return pathlib.Path(directory)


@pytest.fixture(scope="session")
def tokenized_corpus(tmp_path_factory) -> pathlib.Path:
  """The embedded corpus (a part of each train split, the whole validation splits), tokenized."""
  from sparsetx.data import corpus

  documents = {
    "stories": {"train": corpus.stories("train")[:1500], "validation": corpus.stories("validation")[:100]},
    "facts": {"train": corpus.fact_documents("train")[:3000], "validation": corpus.fact_documents("validation")},
  }
  return write_tokenized_corpus(tmp_path_factory.mktemp("tokenized"), documents)


MICRO_TRAIN_FLAGS = [  # a micro dense model the multi-process and command-line training tests start quickly
  "--config.model.d_model=64",
  "--config.model.n_layers=2",
  "--config.model.max_len=32",
  "--config.model.dtype=float32",
  "--config.data.seq_len=32",
  "--config.data.global_batch_size=8",
  "--config.data.eval_batch_size=8",
]


@pytest.fixture(autouse=True)
def own_autotune_table(request, monkeypatch):
  """Every test (and the programs it starts) reads and writes a kernel table of its own, empty until written: never
  the developer's ~/.cache/sparsetx/autotune.json. A test that sets the variable itself sets it after this."""
  from sparsetx.kernels import autotune_table

  name = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
  monkeypatch.setenv(autotune_table.ENV, os.path.join(_SESSION_TMP, "autotune-tables", f"{name}.json"))


def pytest_collection_modifyitems(config, items):
  """The tests marked slow run first: with pytest-xdist's two workers the suite's end is then many short tests
  spread over both, not one worker alone on a long one."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)


class SmallFilesystem:
  """A filesystem that really fills: a 64 MiB tmpfs, with a ballast file that leaves as many bytes free as asked."""

  SIZE = "64m"

  def __init__(self, path: pathlib.Path):
    self.path = path
    self._ballast = path / ".ballast"

  def leave_free(self, free_bytes: int) -> None:
    """Fills the filesystem (on top of what it holds) until `free_bytes` are left, give or take a page."""
    stats = os.statvfs(self.path)
    size = stats.f_bavail * stats.f_frsize - free_bytes
    assert size > 0, f"{self.path} has less than {free_bytes} bytes free already"
    with open(self._ballast, "ab") as f:
      f.write(b"\0" * size)

  def make_room(self) -> None:
    self._ballast.unlink(missing_ok=True)


@pytest.fixture
def small_filesystem(tmp_path):
  """A 64 MiB tmpfs mounted under tmp_path (root on Linux, as CI runs; elsewhere the test is skipped, saying why)."""
  mount_point = tmp_path / "small"
  mount_point.mkdir()
  mounted = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", f"size={SmallFilesystem.SIZE}", "tmpfs", str(mount_point)],
    capture_output=True,
    text=True,
  )
  if mounted.returncode != 0:
    pytest.skip(f"a size-limited tmpfs cannot be mounted here (needs root on Linux): {mounted.stderr.strip()}")
  try:
    yield SmallFilesystem(mount_point)
  finally:
    subprocess.run(["umount", "-l", str(mount_point)], check=True)

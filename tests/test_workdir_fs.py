"""A gs:// workdir on a fake Cloud Storage that runs offline: training there, resuming, evaluating.

The fake maps gs://BUCKET/PATH to a local directory at the libraries' own seams: etils.epath's backend
for gs:// paths (every file the stack reads or writes goes through it), and the kvstore orbax gives
tensorstore for a gs:// checkpoint (a file kvstore instead of the GCS one), with no hierarchical
namespace to ask the GCS API about. Orbax runs its gs:// logic (no atomic rename of a step directory:
a commit marker instead). TensorBoard's events go through TensorFlow's own filesystems, which cannot be
faked from Python: its writer is pointed at a local directory here. Anything written to a gs:// path
outside epath would land in a local 'gs:' directory of the working directory, which the test checks.
"""

import errno
import json
import os
import unittest.mock

import jax
import numpy as np
import pytest
from etils.epath import backend as backend_lib
from etils.epath import gpath
from export_checks import assert_same_export, random_params
from orbax.checkpoint._src.path import gcs_utils
from tensorboard.backend.event_processing import plugin_event_accumulator
from test_train import micro_config

from sparsetx import paths
from sparsetx.data import token_store
from sparsetx.evaluate import perplexity
from sparsetx.hf import export
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import state as state_lib
from sparsetx.train.checkpoints import checkpointing
from sparsetx.train.run import loop
from sparsetx.train.tracking import metrics as metrics_lib


class _FakeGcsBackend(backend_lib._OsPathBackend):  # noqa: SLF001  (epath's local backend, on mapped paths)
  """gs://BUCKET/PATH <-> ROOT/BUCKET/PATH; other paths pass unchanged (a copy between local and gs://)."""

  def __init__(self, root: str):
    self.root = root

  def local(self, path) -> str:
    path = os.fspath(path)
    return os.path.join(self.root, path[len("gs://") :]) if path.startswith("gs://") else path

  def url(self, path) -> str:
    path = os.fspath(path)
    return "gs://" + os.path.relpath(path, self.root) if path.startswith(self.root + os.sep) else path

  def open(self, path, mode):
    return super().open(self.local(path), mode)

  def exists(self, path):
    return super().exists(self.local(path))

  def isdir(self, path):
    return super().isdir(self.local(path))

  def listdir(self, path):
    return super().listdir(self.local(path))

  def glob(self, path):
    return [self.url(p) for p in super().glob(self.local(path))]

  def walk(self, top, *, top_down=True, on_error=None):
    for root, dirs, files in super().walk(self.local(top), top_down=top_down, on_error=on_error):
      yield self.url(os.fspath(root)), dirs, files

  def makedirs(self, path, *, exist_ok=False, mode=0o777):
    return super().makedirs(self.local(path), exist_ok=exist_ok, mode=mode)

  def mkdir(self, path, *, exist_ok=False, mode=0o777):
    return super().mkdir(self.local(path), exist_ok=exist_ok, mode=mode)

  def rmtree(self, path):
    return super().rmtree(self.local(path))

  def remove(self, path):
    return super().remove(self.local(path))

  def rename(self, path, dst):
    return super().rename(self.local(path), self.local(dst))

  def replace(self, path, dst):
    return super().replace(self.local(path), self.local(dst))

  def copy(self, path, dst, overwrite):
    return super().copy(self.local(path), self.local(dst), overwrite=overwrite)

  def stat(self, path):
    return super().stat(self.local(path))


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
  """The local directory that holds the fake buckets; the test runs in another, checked for stray 'gs:' files."""
  root, cwd = tmp_path / "buckets", tmp_path / "cwd"
  root.mkdir()
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  fake = _FakeGcsBackend(str(root))
  real_backend = gpath._GPath._backend  # noqa: SLF001
  monkeypatch.setattr(
    gpath._GPath,
    "_backend",
    property(  # noqa: SLF001
      lambda self: fake if self._uri_scheme == "gs" else real_backend.fget(self)
    ),
  )  # noqa: SLF001
  monkeypatch.setattr(gpath, "_GCS_BACKENDS", frozenset({fake}))  # a copy between local and gs:// takes the fake
  monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs", lambda path: {"driver": "file", "path": fake.local(path)})
  monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
  kvstore = token_store._kvstore  # noqa: SLF001  (the token store's TensorStore opens gs:// as orbax's does)
  monkeypatch.setattr(
    token_store,
    "_kvstore",
    lambda path: {"driver": "file", "path": fake.local(str(path))} if str(path).startswith("gs://") else kvstore(path),
  )
  tensorboard_writer = metrics_lib.tensorboard_writer
  monkeypatch.setattr(
    metrics_lib, "tensorboard_writer", lambda logdir, step: tensorboard_writer(fake.local(logdir), step)
  )
  yield root
  assert os.listdir(cwd) == [], "a gs:// path was written outside etils.epath"


def _rows(path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()]


def _tensorboard_steps(logdir, tag) -> list[int]:
  accumulator = plugin_event_accumulator.EventAccumulator(str(logdir))  # TensorBoard's reader: purges orphaned data
  accumulator.Reload()
  return [event.step for event in accumulator.Tensors(tag)]


def test_gs_workdir_resumes_like_the_uninterrupted_run_with_one_metrics_row_per_step(fake_gcs):
  workdir, run = "gs://bucket/run", fake_gcs / "bucket" / "run"
  config = micro_config("mlp", steps=6, warmup_steps=0)
  config.checkpoint.every = 4
  loop.train(config, workdir)  # uninterrupted: saves steps 4 and 6
  assert paths.is_remote(workdir)
  assert (run / "checkpoints" / "6" / "commit_success.txt").exists()  # orbax's gs:// commit, not a rename
  assert (run / "checkpoints" / "4" / "data" / "metadata").exists()  # the data position: an item of the step
  assert (run / "tokenized" / "manifest.json").exists()  # the config's corpus, tokenized into the workdir
  abstract, _, _, _ = state_lib.state_shardings(config, mesh_lib.make_mesh(config.mesh))
  manager = checkpointing.Checkpointer(workdir, config.checkpoint)
  uninterrupted = manager.restore_state(6, abstract)
  manager.close()
  jsonl = run / "metrics.jsonl"
  rows = _rows(jsonl)
  want = {row["step"]: row["loss"] for row in rows if "loss" in row}
  assert sorted(want) == [1, 2, 3, 4, 5, 6]
  # Resuming from step 4 makes rows 5 and 6 stale: mark them, and add a row cut short by a kill.
  stale = [dict(row, loss=123.0) if row["step"] > 4 and "loss" in row else row for row in rows]
  jsonl.write_text("".join(json.dumps(row) + "\n" for row in stale) + '{"step": 7, "lo')

  config.checkpoint.restore_step = 4  # model, optimizer and data position of step 4; step 6 is set aside
  loop.train(config, workdir)
  rows = _rows(jsonl)
  assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3, 4, 5, 6]
  assert {row["step"]: row["loss"] for row in rows if "loss" in row} == want
  assert _tensorboard_steps(run / "tensorboard", "loss") == [1, 2, 3, 4, 5, 6]
  assert list((run / "superseded").glob("*/checkpoints/6"))  # moved through epath, not deleted
  # A read-only opener (evaluation, export, interp) reads the gs:// run: the resumed step 6 is the uninterrupted one.
  _, _, _, params, step = perplexity.restore(workdir, None, mesh="one")
  assert step == 6
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(uninterrupted.params)):
    np.testing.assert_array_equal(a, b)


def test_unwritable_gs_workdir_is_one_line(fake_gcs):
  (fake_gcs / "bucket").write_text("")  # a "bucket" where no object can be created
  with pytest.raises(loop.config_lib.ConfigError, match=r"^--workdir=gs://bucket/run is not writable \(.+\); choose"):
    loop.check_workdir("gs://bucket/run")


def test_export_to_gs_uploads_every_shard_before_the_index_and_a_failed_upload_leaves_nothing(fake_gcs, tmp_path):
  config = micro_config("mlp")
  hf, run = tmp_path / "hf", str(tmp_path / "run")
  export.write_hf(config, random_params(config.model), str(hf))
  export.import_hf(str(hf), run)  # a checkpoint of those parameters
  cap = os.path.getsize(hf / "model.safetensors") // 4
  summary = export.export(run, "gs://bucket/hf", max_shard_size=cap)
  assert summary["out"] == "gs://bucket/hf"
  assert_same_export(hf, fake_gcs / "bucket" / "hf", shards=3)

  copy, uploaded = _FakeGcsBackend.copy, []

  def failing_second_shard(self, path, dst, overwrite):
    if "model-00002-of-" in os.fspath(dst):
      raise OSError(errno.ENOSPC, "No space left on device", os.fspath(dst))
    uploaded.append(os.fspath(dst))
    return copy(self, path, dst, overwrite)

  with unittest.mock.patch.object(_FakeGcsBackend, "copy", failing_second_shard):
    with pytest.raises(paths.StorageError, match=r"^writing gs://bucket/hf2 failed \(No space left on device\)"):
      export.export(run, "gs://bucket/hf2", max_shard_size=cap)
  assert any("model-00001-of-" in name for name in uploaded)  # the first shard was there, and was removed
  assert list((fake_gcs / "bucket" / "hf2").iterdir()) == []
  with pytest.raises(loop.config_lib.ConfigError, match=r"^--out='gs://bucket/hf' already holds files"):
    export.export(run, "gs://bucket/hf")
  with pytest.raises(
    loop.config_lib.ConfigError, match=r"^--workdir='gs://bucket/run' is a URL, but import writes a local"
  ):
    export.import_hf(str(hf), "gs://bucket/run")
  assert not (fake_gcs / "bucket" / "run").exists()
  (fake_gcs / "nobucket").write_text("")  # where no object can be created: refused before the checkpoint is read
  with pytest.raises(loop.config_lib.ConfigError, match=r"^--out='gs://nobucket/hf' cannot be written \(.+\); check"):
    export.export(run, "gs://nobucket/hf")

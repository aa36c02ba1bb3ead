"""An import trusts no file name in model.safetensors.index.json (sparsetx/hf/weight_files.py): every weight_map value
must be a plain file name in the directory, or the import is one sentence (one `error:` line, exit 2 from the program)
before any weights file is read or downloaded, local or gs://, and nothing is written."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest.mock

import pytest
import test_workdir_fs
from conftest import REPO, load_config
from etils import epath
from export_checks import random_params

from sparsetx import config as config_lib
from sparsetx.hf import export, weight_files

fake_gcs = test_workdir_fs.fake_gcs  # the fixture
INDEX = "model.safetensors.index.json"
FIRST = "model-00001-of-00004.safetensors"  # the embedding's shard: the import reads it first


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
  """A GPT-NeoX export in 4 shards (the embedding alone in the first), which imports as it is."""
  config = load_config("configs/pythia.py")
  config.model.update(dict(vocab_size=272, d_model=32, n_layers=1, head_dim=16, max_len=32, dtype="float32"))
  config.model.ffn.update(d_ffw=64)
  config.data.update(seq_len=32, global_batch_size=8, eval_batch_size=8, shuffle_buffer=64)
  config = config_lib.validate(config)
  out = tmp_path_factory.mktemp("export") / "hf"
  export.write_hf(config, random_params(config.model), str(out), max_shard_size=20_000)
  assert sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))[0] == FIRST
  return out


def with_first_shard_named(source, directory, value, index=None):
  """A copy of `source` at `directory` whose index maps the first shard's tensors to `value` (or holds `index`)."""
  shutil.copytree(source, directory)
  content = json.loads((directory / INDEX).read_text())
  content["weight_map"] = {name: value if file == FIRST else file for name, file in content["weight_map"].items()}
  (directory / INDEX).write_text(index if index is not None else json.dumps(content))
  return directory


def refused(value) -> str:
  """The start of the refusal of `value` as a pattern."""
  return re.escape(f"/{INDEX}' maps 'gpt_neox.embed_in.weight' to {value!r}, which is not a plain file name")


@pytest.mark.parametrize(
  "value",
  ["../" + FIRST, "sub/" + FIRST, "ABSOLUTE", "", ".", "..", "sub\\" + FIRST, 3, None, [FIRST]],
)
def test_a_weight_map_value_that_is_not_a_plain_name_is_refused_before_any_read(sharded, tmp_path, value):
  outside = tmp_path / FIRST
  shutil.copy(sharded / FIRST, outside)  # what "../" and the absolute path would reach
  value = str(outside) if value == "ABSOLUTE" else value
  hf = with_first_shard_named(sharded, tmp_path / "hf", value)
  (hf / "sub").mkdir()
  shutil.copy(sharded / FIRST, hf / "sub" / FIRST)
  shutil.copy(sharded / FIRST, hf / ("sub\\" + FIRST))  # a real file by that name: still refused
  before = sorted(os.listdir(tmp_path))
  opened = unittest.mock.Mock(side_effect=AssertionError("a weights file was opened"))
  with unittest.mock.patch.object(weight_files.safetensors, "safe_open", opened):
    with pytest.raises(config_lib.ConfigError, match=refused(value) + ".* fix the index or export the model again"):
      export.import_hf(str(hf), str(tmp_path / "run"))
    with pytest.raises(config_lib.ConfigError, match=refused(value)):
      export.read_tensors(str(hf))
  assert not opened.called and sorted(os.listdir(tmp_path)) == before  # no workdir, no staging left


@pytest.mark.parametrize(
  "index, message",
  [
    ('{"weight_map": ["a"]}', "holds no weight_map object"),
    ('{"metadata": {"total_size": 1}}', "holds no weight_map object"),
    ("[]", "holds no weight_map object"),
    ('{"weight_map": {', "is not valid JSON"),
  ],
)
def test_an_index_without_a_weight_map_object_is_one_sentence(sharded, tmp_path, index, message):
  hf = with_first_shard_named(sharded, tmp_path / "hf", FIRST, index=index)
  with pytest.raises(
    config_lib.ConfigError, match=rf"^{re.escape(repr(f'{hf}/{INDEX}'))} {message}.*; export the model again"
  ):
    export.import_hf(str(hf), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_the_program_refuses_a_name_outside_the_directory_in_one_line(sharded, tmp_path):
  """The shard "../" names is a real one: without the check the import reads it and succeeds."""
  hf = with_first_shard_named(sharded, tmp_path / "hf", "../" + FIRST)
  os.rename(hf / FIRST, tmp_path / FIRST)
  workdir = tmp_path / "run"
  result = subprocess.run(
    [sys.executable, "-m", "sparsetx.tools.export", f"--import_from={hf}", f"--workdir={workdir}"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 2, result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
  assert f"'{hf}/{INDEX}' maps 'gpt_neox.embed_in.weight' to '../{FIRST}'" in errors[0]
  assert sorted(os.listdir(tmp_path)) == sorted([FIRST, "hf"])  # no workdir, no staging directory


def test_a_gs_import_downloads_nothing_for_a_name_outside_the_directory(sharded, fake_gcs):
  bucket = fake_gcs / "bucket"
  hf = with_first_shard_named(sharded, bucket / "hf", "../" + FIRST)
  os.rename(hf / FIRST, bucket / FIRST)
  listed = sorted(str(p.relative_to(fake_gcs)) for p in fake_gcs.rglob("*"))
  copy = type(epath.Path("gs://bucket")._backend).copy  # noqa: SLF001  (the fake store's copy)
  fetched = []

  def counted(self, path, dst, overwrite):
    fetched.append(os.fspath(path))
    return copy(self, path, dst, overwrite)

  with unittest.mock.patch.object(type(epath.Path("gs://bucket")._backend), "copy", counted):  # noqa: SLF001
    with pytest.raises(
      config_lib.ConfigError,
      match=re.escape(f"'gs://bucket/hf/{INDEX}' maps 'gpt_neox.embed_in.weight' to '../{FIRST}'"),
    ):
      export.import_hf("gs://bucket/hf", str(fake_gcs.parent / "run"))
  assert fetched == []  # not the shard outside, not even config.json
  assert sorted(str(p.relative_to(fake_gcs)) for p in fake_gcs.rglob("*")) == listed
  assert not os.path.exists(os.path.join(tempfile.gettempdir(), FIRST))  # where "../" from the staging points
  assert not (fake_gcs.parent / "run").exists()

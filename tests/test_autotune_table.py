"""The autotune table's key names the kernel (its options and its code's version), the table lives where
$SPARSETX_AUTOTUNE_TABLE points (gs:// included, through sparsetx.paths), every process of a run follows process
0's entries, and a call the table lacks is one line naming it and what runs instead."""

import json
import logging
import os
import pathlib
import subprocess
import sys
import unittest.mock

import pytest
import test_workdir_fs
from conftest import REPO
from etils import epath
from etils.epath import stat_utils

from sparsetx import paths
from sparsetx.config import ConfigError
from sparsetx.kernels import autotune_table, registry
from sparsetx.kernels.device import TracedDevice
from sparsetx.kernels.options import KernelOptions
from sparsetx.tools import launch_local

fake_gcs = test_workdir_fs.fake_gcs  # the fixture

H100 = TracedDevice("gpu", "NVIDIA H100 80GB HBM3", 132)
SHAPE = "bfloat16 gate-inside D512 S128 N16384"
RANKED = autotune_table.Entry(("xla", "triton"), {}, {"xla": 1.0, "triton": 2.0})
REVERSED = autotune_table.Entry(("triton", "xla"), {}, {"xla": 2.0, "triton": 1.0})


def test_a_verdict_at_other_kernel_options_is_not_taken():
  """A tune at segment_chunk=64 says nothing about 32 (another cut of hot rows), nor about another block size; the
  implementation asked for and interpret mode are not the kernel's options."""
  autotune_table.record(H100.device_kind, "rows", SHAPE, RANKED, KernelOptions(segment_chunk=64))
  assert autotune_table.lookup(H100.device_kind, "rows", SHAPE, KernelOptions(segment_chunk=64)) == RANKED
  assert autotune_table.lookup(H100.device_kind, "rows", SHAPE, KernelOptions("triton", interpret=True)) == RANKED
  nearer = SHAPE.replace("N16384", "N8192")
  for other in (KernelOptions(segment_chunk=32), KernelOptions(block_d=256), KernelOptions(group_rows=64)):
    assert autotune_table.lookup(H100.device_kind, "rows", SHAPE, other) is None, other
    assert autotune_table.lookup(H100.device_kind, "rows", nearer, other, nearest=True) is None, other
  assert autotune_table.lookup(H100.device_kind, "rows", nearer, KernelOptions(), nearest=True) == RANKED
  with unittest.mock.patch.object(registry, "target", lambda: H100):  # the registry asks with the call's options
    assert registry.rows(KernelOptions(), SHAPE).name == "xla"
    assert registry.rows(KernelOptions(segment_chunk=32), SHAPE).name == "triton"  # DEFAULT_ORDER's first


def test_an_entry_of_other_kernel_code_matches_nothing_also_through_the_workdir_copy(tmp_path, monkeypatch):
  """A verdict measured on other kernels' code (a workdir copy from before an upgrade) is carried as it is and never
  followed: the call is measured again."""
  workdir = epath.Path(tmp_path)
  with monkeypatch.context() as patched:
    patched.setattr(autotune_table, "code_version", lambda: "0123456789ab")
    autotune_table.record(H100.device_kind, "rows", SHAPE, RANKED)
    autotune_table.keep_in(workdir)
  monkeypatch.setenv(autotune_table.ENV, str(tmp_path / "fresh.json"))  # the next host's empty table
  assert autotune_table.lookup(H100.device_kind, "rows", SHAPE) is None
  assert autotune_table.take_from(workdir) == 1
  assert autotune_table.lookup(H100.device_kind, "rows", SHAPE) is None
  assert autotune_table.lookup(H100.device_kind, "rows", SHAPE.replace("N16384", "N8192"), nearest=True) is None
  autotune_table.record(H100.device_kind, "rows", SHAPE, REVERSED)  # measured again, under this code
  assert autotune_table.lookup(H100.device_kind, "rows", SHAPE) == REVERSED


def test_the_code_version_changes_with_any_file_of_the_kernels_package(monkeypatch):
  """A shared helper (rows/row_chunks.py: the hot-row cut) changes what every implementation computes."""
  before = autotune_table.code_version()
  read = pathlib.Path.read_bytes
  edited = lambda self: read(self) + (b"# edited\n" if self.name == "row_chunks.py" else b"")  # noqa: E731
  monkeypatch.setattr(pathlib.Path, "read_bytes", edited)
  monkeypatch.setattr(autotune_table, "_code_version", None)
  assert autotune_table.code_version() != before


def test_a_gs_table_is_written_and_read_in_the_store(fake_gcs, monkeypatch):
  """gs:// goes through epath (the fixture fails on a local 'gs:' directory); a store whose stat has no
  modification time is read again each time, so another writer's ranking is seen."""
  monkeypatch.setenv(autotune_table.ENV, "gs://bucket/tables/t.json")
  assert autotune_table.path() == epath.Path("gs://bucket/tables/t.json")
  autotune_table.check_writable()
  autotune_table.record(H100.device_kind, "rows", SHAPE, RANKED)
  stored = fake_gcs / "bucket" / "tables" / "t.json"
  assert list(json.loads(stored.read_text())["entries"]) == [autotune_table.key(H100.device_kind, "rows", SHAPE)]
  assert sorted(os.listdir(stored.parent)) == ["t.json"]  # no probe or staged file left
  no_mtime = lambda self, path: stat_utils.StatResult(
    is_directory=False, length=os.path.getsize(self.local(path)), mtime=0
  )  # noqa: E731
  monkeypatch.setattr(test_workdir_fs._FakeGcsBackend, "stat", no_mtime)  # noqa: SLF001
  assert autotune_table.lookup(H100.device_kind, "rows", SHAPE) == RANKED
  rewritten = stored.read_text().replace('"xla",\n    "triton"', '"triton",\n    "xla"')
  assert len(rewritten) == len(stored.read_text()) and rewritten != stored.read_text()
  stored.write_text(rewritten)  # another host's verdict, the same length
  assert autotune_table.lookup(H100.device_kind, "rows", SHAPE).ranking == ("triton", "xla")


def test_an_unreachable_store_is_one_sentence(fake_gcs, monkeypatch):
  (fake_gcs / "nobucket").write_text("")  # where no object can be read or created
  monkeypatch.setenv(autotune_table.ENV, "gs://nobucket/t.json")
  unreadable = r"^the autotune table gs://nobucket/t.json cannot be read \(Not a directory\); point \$SPARSETX_AUTO"
  for read in (  # a lookup; a record reads the table before it rewrites it
    lambda: autotune_table.lookup(H100.device_kind, "rows", SHAPE),
    lambda: autotune_table.record(H100.device_kind, "rows", SHAPE, RANKED),
  ):
    with pytest.raises(ConfigError, match=unreadable):
      read()
  with pytest.raises(paths.StorageError, match=r"^writing the autotune table gs://nobucket/t.json failed \(.+\); "):
    autotune_table.check_writable()


def test_a_miss_on_a_gpu_is_one_line_naming_the_call_and_what_runs(caplog):
  caplog.set_level(logging.WARNING)
  with unittest.mock.patch.object(registry, "target", lambda: H100):
    for _ in range(3):  # a layer traced again, and a second layer of the same shapes
      assert registry.rows(KernelOptions(), SHAPE).name == "triton"
    autotune_table.record(H100.device_kind, "rows", SHAPE.replace("D512", "D256"), RANKED)
    assert registry.rows(KernelOptions(), SHAPE.replace("D512", "D256")).name == "xla"  # measured: no line
    with autotune_table.off():  # config.train.autotune=False asked for no table
      registry.rows(KernelOptions(), SHAPE.replace("D512", "D128"))
  registry.rows(KernelOptions(), SHAPE.replace("D512", "D64"))  # this CPU: XLA's, nothing to measure
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("autotune: ")]
  assert lines == [
    f"autotune: rows {SHAPE} on {H100.device_kind} has no entry in the autotune table {autotune_table.path()} "
    f"(sparsetx-autotune measures it); auto runs triton, the first of the default order "
    f"{registry.DEFAULT_ORDER['rows']} that takes it"
  ], lines


AGREEING = r"""
import json, sys
import jax
from etils import epath
from sparsetx.config import ConfigError
from sparsetx.kernels import autotune_table
i, port, shape = int(sys.argv[1]), sys.argv[2], sys.argv[3]
mine = autotune_table.Entry(("xla", "triton") if i == 0 else ("triton", "xla"), {}, {})
autotune_table.record("NVIDIA H100", "rows", shape, mine)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=i, initialization_timeout=60)
seen = {"pinned": autotune_table.agree()}
seen["agreed"] = autotune_table.lookup("NVIDIA H100", "rows", shape).ranking
autotune_table.record("NVIDIA H100", "rows", shape, autotune_table.Entry(("mosaic",), {}, {}))  # written, not read
seen["after record"] = autotune_table.lookup("NVIDIA H100", "rows", shape).ranking
if i == 0:
  autotune_table.path().write_text('{"entries": ')
try:
  autotune_table.agree()
except ConfigError as error:
  seen["corrupt"] = str(error)
workdir = epath.Path(sys.argv[4])  # process 0 takes the workdir's copy inside agree(): its failure stops both
if i == 0:
  autotune_table.path().write_text('{"entries": {}}')
  (workdir / autotune_table.WORKDIR_COPY).write_text("{damaged")
try:
  autotune_table.agree(workdir)
except ConfigError as error:
  seen["copy"] = str(error)
if i == 1:  # another install on this host
  autotune_table._code_version = "0123456789ab"
try:
  autotune_table.agree()
except ConfigError as error:
  seen["install"] = str(error)
print(json.dumps(seen))
"""


def test_two_processes_with_different_tables_follow_process_0(tmp_path):
  """Two hosts' tables rank one call the other way round: after agree() both trace with process 0's ranking, a
  table rewritten afterwards changes nothing, and process 0's unreadable table, its damaged workdir copy, or another
  install on one host stops both with one sentence."""
  port, started = launch_local.free_port(), []
  try:
    for i in range(2):
      env = launch_local.child_env(1) | {autotune_table.ENV: str(tmp_path / f"host{i}.json")}
      command = [sys.executable, "-c", AGREEING, str(i), str(port), SHAPE, str(tmp_path)]
      started.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [process.communicate(timeout=120) for process in started]
  finally:
    for process in started:
      if process.poll() is None:
        process.kill()
  assert [p.returncode for p in started] == [0, 0], [err.decode()[-2000:] for _, err in outputs]
  seen = [json.loads(out.decode().splitlines()[-1]) for out, _ in outputs]
  assert [s["pinned"] for s in seen] == [1, 1]
  assert [s["agreed"] for s in seen] == [["xla", "triton"]] * 2, seen
  assert [s["after record"] for s in seen] == [["xla", "triton"]] * 2, seen
  assert seen[0]["corrupt"].startswith(f"the autotune table {tmp_path}/host0.json cannot be read"), seen
  assert seen[1]["corrupt"].startswith("process 0's autotune table cannot be read"), seen
  assert seen[0]["copy"].startswith(f"the autotune table's copy {tmp_path}/autotune.json cannot be read"), seen
  assert seen[1]["copy"].startswith("process 0's autotune table cannot be read"), seen
  assert all(s["install"].startswith("processes [1] run other kernels or another JAX than process 0") for s in seen)


def test_each_test_reads_a_table_of_its_own():
  """conftest points $SPARSETX_AUTOTUNE_TABLE at an empty per-test path: no test reads the developer's table."""
  assert os.fspath(autotune_table.path()) != os.fspath(pathlib.Path.home() / ".cache" / "sparsetx" / "autotune.json")
  assert not autotune_table.path().exists()
  autotune_table.record(H100.device_kind, "rows", SHAPE, RANKED)
  assert autotune_table.lookup(H100.device_kind, "rows", SHAPE) == RANKED  # the next test finds none: above

"""sparsetx-tokenize on Ray (sparsetx/data/tokenize_ray.py): the local runner with 2 workers writes, byte for byte,
the corpus the single-process job writes; a worker killed in the middle of a shard is retried and its shard
rewritten with no row doubled; a bad file is still one error line."""

import os
import runpy
import signal
import time

import pytest
from test_tokenize import tool

from sparsetx.data import pretokenize, token_store
from sparsetx.tools import bench_data, build_vocab


def write_config(path, source: str, vocab_dir: str = "") -> None:
  vocab = f"  config.data.vocab = dict(kind='gpt2', path={vocab_dir!r})\n" if vocab_dir else ""
  path.write_text(
    "import ml_collections\nfrom sparsetx import config as config_lib\n\n\ndef get_config():\n"
    "  config = config_lib.default_config()\n"
    f"  config.data.sources.web = ml_collections.ConfigDict({source})\n"
    f"{vocab}  config.data.mixture = (('web', 1.0),)\n  return config\n"
  )


def tree(directory) -> dict[str, bytes]:
  return {
    os.path.relpath(os.path.join(root, name), directory): open(os.path.join(root, name), "rb").read()
    for root, _, names in os.walk(directory)
    for name in names
  }


def readers_of(path: str) -> list[int]:
  """The processes that hold `path` open."""
  pids = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      if any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd")):
        pids.append(int(pid))
    except OSError:  # gone, or not ours
      continue
  return pids


@pytest.mark.slow
@pytest.mark.long
def test_two_ray_workers_write_the_single_process_corpus_and_a_killed_worker_doubles_no_row(tmp_path):
  src = tmp_path / "src"
  big = bench_data.generate_text(str(src / "a"), megabytes=16, files=1)[0]  # shard 0 of 2: seconds of BPE
  small = bench_data.generate_text(str(src / "b"), megabytes=0.2, files=1, seed=4)[0]
  vocab_dir = build_vocab.build_gpt2_bpe(str(tmp_path / "bpe"), 300, inputs=[small], max_documents=2000)
  source = f"dict(kind='text', train=({big!r}, {small!r}))"
  write_config(tmp_path / "config.py", source, vocab_dir)
  config = runpy.run_path(str(tmp_path / "config.py"))["get_config"]()
  reference = tmp_path / "reference"
  pretokenize.tokenize_corpus(config, reference, workers=1, shards=2)

  out = tmp_path / "ray"
  shard = token_store.split_dir(out, "web", "train") / token_store.shard_name(0, 2)
  process = tool(f"--config={tmp_path / 'config.py'}", f"--output_dir={out}", "--workers=2", "--shards=2")
  killed, deadline = [], time.monotonic() + 300
  while not killed and process.poll() is None:  # kill the worker of shard 0 once it wrote its first rows
    assert time.monotonic() < deadline, "shard 0 never started"
    if list((shard / "tokens").glob("c/*")) and not (shard / token_store.SHARD_JSON).exists():
      for pid in readers_of(big):
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    time.sleep(0.01)
  _, err = process.communicate(timeout=600)
  assert killed and process.returncode == 0, err[-3000:]
  assert tree(out) == tree(reference)  # the retry rewrote shard 0 from its start: every byte as one process wrote


@pytest.mark.long  # a system case of half a minute or more: make test-long
@pytest.mark.slow
def test_a_bad_file_on_ray_is_one_error_line(tmp_path):
  (tmp_path / "web.jsonl").write_text('{"text": "fine"}\nnot json\n')
  (tmp_path / "more.jsonl").write_text('{"text": "also fine"}\n')
  write_config(
    tmp_path / "config.py",
    f"dict(kind='jsonl', train=({str(tmp_path / 'web.jsonl')!r}, {str(tmp_path / 'more.jsonl')!r}))",
  )
  process = tool(f"--config={tmp_path / 'config.py'}", f"--output_dir={tmp_path / 'out'}", "--workers=2")
  _, err = process.communicate(timeout=300)
  errors = [line for line in err.splitlines() if line.startswith("error: ")]
  assert process.returncode == 2 and len(errors) == 1, err[-3000:]
  assert (
    "web/train/shard_00000_of_00002 failed: " in errors[0] and "web.jsonl: line 2 (byte 17) is not JSON" in errors[0]
  )

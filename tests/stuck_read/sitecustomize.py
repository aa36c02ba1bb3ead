"""Loaded by every Python process started with this directory on PYTHONPATH (tests/test_watchdog_system.py): in the
trainer's process 1 only, the data stream's read of the batch of step STUCK_AT_STEP opens a FIFO nobody writes, so
that process stays alive (its threads, its heartbeats) but stuck in a read, as on a mount that never answers."""

import os

with open("/proc/self/cmdline", "rb") as _cmdline:
  _argv = _cmdline.read().split(b"\0")

if b"--process_id=1" in _argv and os.environ.get("STUCK_READ_FIFO"):
  from sparsetx.data import global_stream

  _next_local = global_stream.GlobalStream.next_local

  def _stuck_next_local(self):
    if self.step + 1 >= int(os.environ["STUCK_AT_STEP"]):
      with open(os.environ["STUCK_READ_FIFO"]) as fifo:  # blocks in open(2) until a writer comes: none does
        fifo.read()
    return _next_local(self)

  global_stream.GlobalStream.next_local = _stuck_next_local

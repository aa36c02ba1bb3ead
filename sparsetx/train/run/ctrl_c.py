"""Ctrl-C in a training run: the first SIGINT asks for what SIGTERM asks (a checkpoint at the step every process
agrees on, then a clean stop); a second one ends the process at once, in one line, with no traceback.

More: docs/modules.md, sparsetx/train/run/ctrl_c.py.
"""

import os
import signal
import threading

ABORT_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for a process that Ctrl-C ended
ABORT_LINE = "Ctrl-C again: stopped at once, without saving; the newest complete checkpoint is where a rerun resumes.\n"
_STOP = b"\0"  # no signal has number 0: the watcher's own word to end


class CtrlC:
  """SIGINT for the training loop, until `restore()`. `on_first()` runs on the first (from a thread: it should
  only set a flag and log); the second writes ABORT_LINE to stderr and exits ABORT_EXIT_CODE.

  Python runs a signal handler only between the main thread's bytecodes, and the main thread may sit for minutes in
  a compile or a wait on the devices. Python's C-level handler also writes each signal's number to the wakeup fd
  (signal.set_wakeup_fd), at once: a thread reading it acts on the signal whatever the main thread is doing. A
  process started with SIGINT ignored (a background job of a non-interactive shell) keeps ignoring it."""

  def __init__(self, on_first):
    self._on_first = on_first
    self._count, self._lock = 0, threading.Lock()
    self._previous = signal.getsignal(signal.SIGINT)
    self._watcher = None
    if self._previous is signal.SIG_IGN:
      return
    self._read_fd, self._write_fd = os.pipe()
    os.set_blocking(self._write_fd, False)
    signal.signal(signal.SIGINT, lambda signum, frame: None)  # no KeyboardInterrupt: the watcher acts
    self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
    self._watcher = threading.Thread(target=self._watch, name="sparsetx-ctrl-c", daemon=True)
    self._watcher.start()

  def _watch(self) -> None:
    while True:
      data = os.read(self._read_fd, 64)
      for byte in data:
        if byte == _STOP[0]:
          return
        if byte == signal.SIGINT:
          self._interrupted()

  def _interrupted(self) -> None:
    with self._lock:
      self._count += 1
      first = self._count == 1
    if first:
      self._on_first()
      return
    os.write(2, ABORT_LINE.encode())
    os._exit(ABORT_EXIT_CODE)

  def restore(self) -> None:
    """Puts back SIGINT's handler and the wakeup fd as they were, and ends the watcher."""
    if self._watcher is None:
      return
    signal.set_wakeup_fd(self._previous_fd)
    signal.signal(signal.SIGINT, self._previous)
    os.write(self._write_fd, _STOP)
    self._watcher.join(timeout=10)
    os.close(self._read_fd)
    os.close(self._write_fd)
    self._watcher = None

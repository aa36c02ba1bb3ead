"""The hang watchdog: a run in which nothing finishes (a step, an evaluation batch, a checkpoint's save call) within
its limit ends with every thread's stack in its log, one `error:` line and WATCHDOG_EXIT_CODE, which the deploy/
recipes restart on (the restart resumes from the newest checkpoint).

What is slow on purpose has its own limit, so a healthy run is never ended by it: a step or a data read has
config.train.step_timeout_s; a first call that compiles (the train step, the evaluation) compile_timeout_s; a save
or a wait for one save_timeout_s; a restore restore_timeout_s. Each None is derived: max(its floor, a factor x the
slowest of its kind measured in this process). On several processes the first to fire tells the others (Peers), so
each writes its own stacks and line before any exits: the one stuck in a read says why. More: docs/modules.md.
"""

import collections
import faulthandler
import os
import sys
import threading
import time

from sparsetx.cli import WATCHDOG_EXIT_CODE

FLOOR_S = 300.0  # the derived step timeout's least value: longer than JAX's heartbeat timeout (100 s), see docs
STEP_FACTOR = 20.0  # the derived step timeout: this many times the slowest of the last measured steps
MEASURED = 100  # steps whose times the derived timeout reads
KINDS = ("step", "compile", "save", "restore")
# The derived limits of what is slow on purpose. A 16-layer sgatlin step compiled in 174 s for a v5p here and a
# pod's in minutes more; a multi-GB state on slow object storage saves and restores in minutes: half an hour each
# is far above a healthy one and still ends a true hang within the hour.
SLOW_FLOORS_S = dict(compile=1800.0, save=1800.0, restore=1800.0)
SLOW_FACTOR = 4.0  # the derived slow limits: this many times the slowest of the kind measured so far
PEER_WAIT_PERIODS = 4  # a fired process waits this many watch periods for its peers' lines before it exits
COORDINATOR_LINGER_S = 1.0  # process 0 hosts the coordination service: it exits after its peers, so none aborts first


class Peers:
  """The run's processes, through JAX's coordination key-value store: each that fires posts its line under its own
  key. A peer's watchdog reads the posts (on a thread of its own: a read from a stopped coordinator may never
  return) and fires too; a fired process waits, bounded, for every post before it exits, because an exit first ends
  the others: their collectives fail, and process 0's exit takes the coordination service with it."""

  PREFIX = "sparsetx_watchdog/"

  def __init__(self, client, count: int, process: int):
    self._client, self.count, self.process = client, count, process

  @classmethod
  def of_this_run(cls, process: int) -> "Peers | None":
    """None on one process; else the client `jax.distributed.initialize` made (JAX keeps it in a private module,
    as orbax and multihost_utils read it)."""
    import jax
    from jax._src import distributed

    if jax.process_count() == 1 or distributed.global_state.client is None:
      return None
    return cls(distributed.global_state.client, jax.process_count(), process)

  def posted(self) -> dict[int, str]:
    """{process: its error line} of every process that has fired."""
    return {int(key.rsplit("/", 1)[-1]): line for key, line in self._client.key_value_dir_get(self.PREFIX)}

  def post(self, line: str) -> None:
    self._client.key_value_set(f"{self.PREFIX}{self.process}", line, allow_overwrite=True)


def timeout_words(setting, kind: str = "step") -> str:
  return f"config.train.{kind}_timeout_s={setting}" if setting else f"the derived {kind} timeout"


class Watchdog:
  """`doing` names what runs and its kind (the error line says both); `progress` after each step, evaluation batch
  and save call; `measured` adds a slow kind's duration. The step kind is armed by the first finished step; the
  slow kinds always are."""

  def __init__(self, setting: float | None, process: int = 0, slow: dict | None = None, peers: Peers | None = None):
    """`setting`: the step limit in seconds, 0 (the watchdog off) or None (derived: max(FLOOR_S, STEP_FACTOR x the
    slowest measured step)); `slow`: {compile|save|restore: seconds or None (derived)}; `peers`: the run's other
    processes (None: this one alone)."""
    self._settings = dict.fromkeys(KINDS) | (slow or {}) | dict(step=setting)
    self._process = process
    self._measured = {kind: collections.deque(maxlen=MEASURED) for kind in KINDS}
    # (when the last thing finished, what runs, its kind): one tuple, which the watching thread reads whole
    self._since = time.monotonic(), "the first step", "compile"
    self._last_step = None
    self._armed = False
    self._stop = threading.Event()
    self._peers = peers
    self._peer_fired = None  # the lowest process whose post the listening thread has read
    self._thread = None
    if setting != 0:
      self._thread = threading.Thread(target=self._watch, name="sparsetx-watchdog", daemon=True)
      self._thread.start()
      if peers is not None:
        threading.Thread(target=self._listen, name="sparsetx-watchdog-peers", daemon=True).start()

  def limit(self, kind: str = "step") -> float:
    if self._settings[kind]:
      return float(self._settings[kind])
    if kind == "step":
      return max(FLOOR_S, STEP_FACTOR * max(self._measured["step"], default=0.0))
    return max(SLOW_FLOORS_S[kind], SLOW_FACTOR * max(self._measured[kind], default=0.0))

  def measured(self, kind: str, seconds: float) -> None:
    """A compile, save or restore took `seconds`: its kind's derived limit follows the slowest."""
    self._measured[kind].append(seconds)

  def progress(self, step: int | None = None, step_s: float | None = None) -> None:
    """Something finished: `step` (with its time `step_s` when it is a plain step: no compile, save or evaluation
    inside it), or an evaluation batch or a save call (no arguments)."""
    now = time.monotonic()
    if step is not None:
      self._last_step, self._armed = step, True
      if step_s is not None:
        self._measured["step"].append(step_s)
    self._since = now, *self._since[1:]

  def doing(self, what: str, kind: str = "step") -> None:
    """What runs now, for the error line ('step 120', 'the evaluation after step 100', 'saving step 200'), and
    which limit it has."""
    self._since = time.monotonic(), what, kind

  def close(self) -> None:
    self._stop.set()

  def _period(self) -> float:
    return min(5.0, min(self.limit(kind) for kind in KINDS) / 4)

  def _watch(self) -> None:
    while not self._stop.wait(self._period()):
      last, doing, kind = self._since
      waited = time.monotonic() - last
      if ((self._armed or kind != "step") and waited > self.limit(kind)) or self._peer_fired is not None:
        self._fire(waited, doing, kind)

  def _listen(self) -> None:
    while not self._stop.wait(self._period()):
      try:
        posted = self._peers.posted()
      except Exception:  # noqa: BLE001 (a coordinator slow or gone: ask again; this process's own limit holds)
        continue
      if posted:
        self._peer_fired = min(posted)
        return

  def _fire(self, waited: float, doing: str, kind: str) -> None:
    """Writes every thread's stack and one line to stderr, posts the line to the peers and waits for theirs
    (bounded), then ends the process (a hung collective or read would never return to let it end otherwise)."""
    sys.stderr.write(f"\nsparsetx watchdog, process {self._process}: the stacks of all threads:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    told = "" if self._peer_fired is None else f" (process {self._peer_fired}'s watchdog fired first)"
    line = (
      f"error: process {self._process}: nothing finished for {waited:.0f} s ({timeout_words(self._settings[kind], kind)}: "
      f"{self.limit(kind):.0f} s) while running {doing}; the last finished step is {self._last_step}{told}. A peer or "
      "a read hangs; the stacks are in the log above. Exiting with code "
      f"{WATCHDOG_EXIT_CODE}: run the same command again to resume from the newest checkpoint."
    )
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    if self._peers is not None:
      waiting = threading.Thread(target=self._wait_for_peers, args=(line,), name="sparsetx-watchdog-post", daemon=True)
      waiting.start()
      waiting.join(PEER_WAIT_PERIODS * self._period())  # a stopped peer or coordinator never answers
    os._exit(WATCHDOG_EXIT_CODE)

  def _wait_for_peers(self, line: str) -> None:
    try:
      self._peers.post(line)
      while len(self._peers.posted()) < self._peers.count:
        time.sleep(0.2)
    except Exception:  # noqa: BLE001 (the coordinator is gone: nobody is left to wait for)
      return
    if self._process == 0:
      time.sleep(COORDINATOR_LINGER_S)

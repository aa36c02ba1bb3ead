"""Row-kernel implementations the autotune tests measure in child processes (named `autotune_fakes:NAME`): XLA's
own, but one refuses, one kills its process as a faulting kernel would, one is 1% off (one in its gradients only),
one slow (it sleeps), one hangs, one reports its environment, and one plain."""

import os
import signal
import time

import jax

from sparsetx.kernels.rows import xla
from sparsetx.kernels.rows.records import Rows


def xla_rows(cls, name):
  """XLA's record as `cls`, without the CPU's row-order walk (their token-order forms run)."""
  return cls(name, None, module=xla, fused=True)


class Refuses(Rows):
  def refuse(self, device, options, call=None):
    raise NotImplementedError("it needs a Hopper GPU (a test implementation)")


class Faults(Rows):
  def forward(self, *args):
    os.kill(os.getpid(), signal.SIGILL)  # an illegal instruction in a kernel ends the process


class Wrong(Rows):
  def forward(self, *args):
    y_ND, h_NS = super().forward(*args)
    return y_ND * 1.01, h_NS


class Slow(Rows):
  """XLA's values, after a host callback that sleeps 50 ms on every forward: slower by construction."""

  def forward(self, *args):
    y_ND, h_NS = super().forward(*args)
    return jax.pure_callback(_after_a_nap, jax.ShapeDtypeStruct(y_ND.shape, y_ND.dtype), y_ND), h_NS


def _after_a_nap(y):
  time.sleep(0.05)
  return y


REFUSES, FAULTS, WRONG, SLOW = (
  xla_rows(c, n) for c, n in ((Refuses, "refuses"), (Faults, "faults"), (Wrong, "wrong"), (Slow, "slow"))
)
FAST = xla_rows(Rows, "fast")


class WrongGradients(Rows):
  """XLA's outputs, but x's gradient 1% off: only a check of the backward catches it."""

  def backward_rows(self, *args):
    dx_ND, *rest = super().backward_rows(*args)
    return (dx_ND * 1.01, *rest)


class Hangs(Rows):
  """Answers only after 120 s: a child past the autotuner's time limit."""

  def refuse(self, device, options, call=None):
    time.sleep(120)


class ReportsEnvironment(Rows):
  """Refuses with the preallocation setting its process inherited: what the spawning process had at spawn time."""

  def refuse(self, device, options, call=None):
    raise NotImplementedError(f"XLA_PYTHON_CLIENT_PREALLOCATE={os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')}")


WRONG_GRADIENTS, HANGS, REPORTS_ENVIRONMENT = (
  xla_rows(WrongGradients, "wrong_gradients"),
  xla_rows(Hangs, "hangs"),
  xla_rows(ReportsEnvironment, "env"),
)

"""Row-kernel implementations the autotune tests measure in child processes (named `autotune_fakes:NAME`): XLA's
own, but one refuses, one kills its process as a faulting kernel would, one is 1% off (one in its gradients only),
one slow (it sleeps), one hangs, one reports its environment, and one plain."""

import os
import signal
import time

import jax

from sparsetx.kernels.backend import XlaRows as Xla


class XlaRows(Xla):
  row_order = False  # their token-order forms run (the CPU's row-order walk would skip them)


class Refuses(XlaRows):
  def refuse(self, device, options, call=None):
    raise NotImplementedError("it needs a Hopper GPU (a test implementation)")


class Faults(XlaRows):
  def forward(self, *args):
    os.kill(os.getpid(), signal.SIGILL)  # an illegal instruction in a kernel ends the process


class Wrong(XlaRows):
  def forward(self, *args):
    y_ND, h_NS = super().forward(*args)
    return y_ND * 1.01, h_NS


class Slow(XlaRows):
  """XLA's values, after a host callback that sleeps 50 ms on every forward: slower by construction."""

  def forward(self, *args):
    y_ND, h_NS = super().forward(*args)
    return jax.pure_callback(_after_a_nap, jax.ShapeDtypeStruct(y_ND.shape, y_ND.dtype), y_ND), h_NS


def _after_a_nap(y):
  time.sleep(0.05)
  return y


REFUSES, FAULTS, WRONG, SLOW = Refuses("refuses"), Faults("faults"), Wrong("wrong"), Slow("slow")
FAST = XlaRows("fast")


class WrongGradients(XlaRows):
  """XLA's outputs, but x's gradient 1% off: only a check of the backward catches it."""

  def backward_rows(self, *args):
    dx_ND, *rest = super().backward_rows(*args)
    return (dx_ND * 1.01, *rest)


class Hangs(XlaRows):
  """Answers only after 120 s: a child past the autotuner's time limit."""

  def refuse(self, device, options, call=None):
    time.sleep(120)


class ReportsEnvironment(XlaRows):
  """Refuses with the preallocation setting its process inherited: what the spawning process had at spawn time."""

  def refuse(self, device, options, call=None):
    raise NotImplementedError(f"XLA_PYTHON_CLIENT_PREALLOCATE={os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')}")


WRONG_GRADIENTS, HANGS, REPORTS_ENVIRONMENT = (
  WrongGradients("wrong_gradients"),
  Hangs("hangs"),
  ReportsEnvironment("env"),
)

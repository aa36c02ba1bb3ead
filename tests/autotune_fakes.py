"""Row-kernel implementations the autotune tests measure in child processes (named `autotune_fakes:NAME`): XLA's
own, but one refuses, one kills its process as a faulting kernel would, one is 1% off, one slow and one fast."""

import os
import signal

from sparsetx.kernels.backend import XlaRows as Xla


class XlaRows(Xla):
  row_order = False  # their token-order forms run (the CPU's row-order walk would skip them)


class Refuses(XlaRows):
  name = "refuses"

  def refuse(self, device, options, call=None):
    raise NotImplementedError("it needs a Hopper GPU (a test implementation)")


class Faults(XlaRows):
  name = "faults"

  def forward(self, *args):
    os.kill(os.getpid(), signal.SIGILL)  # an illegal instruction in a kernel ends the process


class Wrong(XlaRows):
  name = "wrong"

  def forward(self, *args):
    y_ND, h_NS = super().forward(*args)
    return y_ND * 1.01, h_NS


class Chunked(XlaRows):
  """XLA's token-order forms with `token_chunk` tokens per loop trip: the same values (each token's sums are its
  own), more trips the smaller the chunk."""

  def __init__(self, name, token_chunk):
    self.name, self.token_chunk = name, token_chunk

  def forward(self, *args):
    return super().forward(*args[:-1], args[-1]._replace(token_chunk=self.token_chunk))

  def backward_rows(self, *args):
    return super().backward_rows(*args[:-1], args[-1]._replace(token_chunk=self.token_chunk))


REFUSES, FAULTS, WRONG = Refuses(), Faults(), Wrong()
SLOW, FAST = Chunked("slow", 1), Chunked("fast", 256)

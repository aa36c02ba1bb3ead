"""Running PyTorch in a process that also holds TensorFlow (seqio's reader): the programs that score or export with
torch beside sparsetx's data path call `keep_triton_out()` before torch loads.

torch's CUDA wheels (the only torch PyPI has for Python 3.12 on x86-64) bring the `triton` package, and importing it
after TensorFlow crashes the process (a segfault inside triton's native library; both bundle LLVM). torch imports
triton only if it can (torch._dynamo probes for it when transformers loads) and runs without it, which is all these
programs need: JAX's Pallas Triton path does not use that package.
"""

import sys


def keep_triton_out() -> None:
  """Marks the `triton` package absent for this process unless it is already loaded (torch's probe then fails cleanly)."""
  sys.modules.setdefault("triton", None)

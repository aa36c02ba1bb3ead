"""The row op's implementations, one line each, in the order Mosaic GPU, Triton, Pallas TPU, XLA: a module of row
kernels (one file each, named by its registry key) and the designs composed onto it (rows/records.py). A new
implementation is its file and one line here; kernels/registry.py selects among them.

More: docs/modules.md, sparsetx/kernels/rows/table.py.
"""

from sparsetx.kernels.platform import hopper_or_newer
from sparsetx.kernels.rows import mosaic, tpu, triton, xla
from sparsetx.kernels.rows.records import Rows

HOPPER = (lambda device: hopper_or_newer(device.device_kind), "a Hopper or newer GPU (sm_90+)")

# The tilings sparsetx-autotune --tilings measures beside the config's (kernel.block_tokens, block_d, stages): Triton's
# token block and d chunk, Mosaic GPU's d chunk and pipeline depth (each an upper bound it fits to the device).
TRITON_TILINGS = ({"block_tokens": 16}, {"block_tokens": 32}, {"block_d": 256}, {"block_tokens": 16, "block_d": 256})
MOSAIC_TILINGS = ({"stages": 2}, {"stages": 4}, {"block_d": 64}, {"block_d": 256})
TRITON = dict(
  module=triton, refused_on=("tpu",), tilings=TRITON_TILINGS
)  # where the Triton family runs, what it offers
TPU = dict(module=tpu, refused_on=("gpu",))

ROWS = (
  Rows("mosaic", "gpu", module=mosaic, needs=HOPPER, refused_on=("tpu",), tilings=MOSAIC_TILINGS),
  Rows("triton", "gpu", interprets_by_default=True, **TRITON),
  Rows("triton_row_order", "gpu", row_order=True, **TRITON),
  Rows("triton_fused", "gpu", fused=True, **TRITON),
  Rows("tpu", "tpu", **TPU),
  Rows("tpu_row_order", "tpu", row_order=True, **TPU),
  Rows("tpu_fused", "tpu", fused=True, **TPU),
  Rows("xla_row_order", None, module=xla, row_order=True),
  Rows("xla", None, module=xla, fused=True, cpu_row_sorted=True),
)

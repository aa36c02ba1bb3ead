"""The grouped matmul's implementations, one line each, in the order Mosaic GPU, Triton, Pallas TPU, XLA (one file
each, named by its registry key). A new implementation is its file and one line here.

More: docs/modules.md, sparsetx/kernels/grouped_matmul/table.py.
"""

from sparsetx.kernels.grouped_matmul import mosaic, tpu, triton
from sparsetx.kernels.grouped_matmul.interface import GroupedKernels, GroupedXla
from sparsetx.kernels.rows.table import HOPPER

GROUPED = (
  GroupedKernels("mosaic", "gpu", module=mosaic, tgmm_module=triton, needs=HOPPER, refused_on=("tpu",)),
  GroupedKernels("triton", "gpu", module=triton, refused_on=("tpu",), interprets_by_default=True),
  GroupedKernels("tpu", "tpu", module=tpu, refused_on=("gpu",)),
  GroupedXla("xla", None),
)

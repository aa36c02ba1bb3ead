"""The names of the scopes (jax.named_scope) that mark a train step's parts in its compiled program.

A leaf module: the kernels, the layers and the step put these scopes around their parts, and the trace reader
(perf/step_parts.py) finds the parts by them, so neither side imports the other.
"""

ROUTER = "router"  # sgatlin / PEER product keys and their top-k, MoE's router, FFF's walk down its trees
ROW_GATHER = "row_gather"  # the gated gather's row kernels, forward and backward (dx, dgates)
TABLE_GRADS = "table_grads"  # the tables' gradients: SORT (pairs by row, row starts), SEGMENT_SUMS, COMBINE
SORT, SEGMENT_SUMS, COMBINE = "sort", "segment_sums", "combine"
OPTIMIZER = "optimizer"  # the AdamW update of every parameter
LOSS = "loss"  # the LM head and cross-entropy over vocabulary tiles

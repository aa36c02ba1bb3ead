"""The names of the scopes (jax.named_scope) that mark a train step's parts in its compiled program, and of the
values a remat policy may save by name (jax.ad_checkpoint.checkpoint_name, put on by models/taps.py).

A leaf module: the kernels, the layers and the step put these scopes around their parts, and the trace reader
(perf/step_parts.py) finds the parts by them, so neither side imports the other.
"""

ROUTER = "router"  # sgatlin / PEER product keys and their top-k, MoE's router, FFF's walk down its trees
ROW_GATHER = "row_gather"  # the gated gather's row kernels, forward and backward (dx, dgates)
TABLE_GRADS = "table_grads"  # the tables' gradients: SORT (pairs by row, row starts), SEGMENT_SUMS, COMBINE
SORT, SEGMENT_SUMS, COMBINE = "sort", "segment_sums", "combine"
OPTIMIZER = "optimizer"  # the AdamW update of every parameter
LOSS = "loss"  # the LM head and cross-entropy over vocabulary tiles

# Values saved by name under config.model.remat=save_routing: the attention output and each sparse layer's routing
# (sgatlin / PEER indices and gates, MoE experts and weights), the taps of the same names; the block's input is
# the rematerialized body's argument, always kept.
ATTENTION_OUTPUT = "attention_output"
ROUTED_INDICES = "routed_indices"  # product-key top-k's picks, where its gather reads them (models/ffn/product_keys.py)
ROUTING = (ROUTED_INDICES, "gate_indices", "gate_scores", "expert_ids", "expert_weights")
SAVED_BY_NAME = (ATTENTION_OUTPUT, *ROUTING)

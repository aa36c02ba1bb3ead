"""MoE's grouped matmul: its op with the custom VJP, the interface of its implementations, one file per
implementation named by its registry key, and their table.

More: docs/modules.md, sparsetx/kernels/grouped_matmul/."""

"""The gated gather (sgatlin, PEER, FFF's deep levels): its op with the custom VJP and its forms, the row-kernel
interface and the composition over it, one file per implementation named by its registry key, and their table.

More: docs/modules.md, sparsetx/kernels/rows/."""

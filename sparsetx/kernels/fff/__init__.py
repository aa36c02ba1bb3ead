"""FFF's walk down its trees: the route (tree_paths, sparse_forward) and the walk's two forms.

More: docs/modules.md, sparsetx/kernels/fff/."""

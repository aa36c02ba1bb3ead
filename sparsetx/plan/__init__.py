"""How a config runs on a machine: table placement, the step's cost, device memory, targets and the reports.

Between `sparsetx.models` (each FfnSpec brings its own cost and residual bytes) and `sparsetx.train` (which
resolves the plan once, at setup).
"""

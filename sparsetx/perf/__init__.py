"""How fast and how large: the chips, the roofline, the cost vocabulary and the readers of compiled programs.

A leaf below `sparsetx.parallel`: it imports no other sparsetx package, so the kernels, the parallel runtime,
the feed-forward types and the planner all describe their cost in its terms.
"""

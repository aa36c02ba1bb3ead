"""Measuring and planning a run without training it: the ahead-of-time compile and its report, the step and kernel
benchmarks' cases, and the sweeps of a config's ladder.

Above `sparsetx.train` (it compiles the trainer's step) and below the programs that read a trained model.
"""

"""The run and what keeps it alive: the loop and its operations (the watchdog, the agreement on signals and saves by
time, goodput, bad steps and rollback, the compilation cache, Ctrl-C).

Above the step (sparsetx/train/state.py, step.py), which it drives, and beside checkpoints/ and tracking/, which its
operations call.
"""

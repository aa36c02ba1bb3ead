"""The loop's operations, one per file, each an `Operation` (sparsetx/train/run/operation.py) that the loop's
OPERATIONS list runs in order around every step."""

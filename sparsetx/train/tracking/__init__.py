"""Tracking: the metrics writers (metrics.jsonl, TensorBoard, W&B, scalars only) and what they report beside the
loss: the sparse layers' statistics and usage windows."""

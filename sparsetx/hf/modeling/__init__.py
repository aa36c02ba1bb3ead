"""PyTorch modeling files copied into exported sparse-model directories (loaded with trust_remote_code)."""

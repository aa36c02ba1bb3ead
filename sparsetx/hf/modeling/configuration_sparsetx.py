"""Hugging Face config of an exported sparsetx model (copied into the export directory as remote code).

The full sparsetx model config travels as the `sparsetx_model` dict (the same fields as config.model in
sparsetx/config/schema.py); the usual Hugging Face fields are derived from it at export so tools that read
them (vocab size, width, depth, special ids) work unchanged. Standalone: imports transformers only.
"""

from transformers import PreTrainedConfig


class SparsetxConfig(PreTrainedConfig):
  model_type = "sparsetx"

  sparsetx_model: dict | None = None  # sparsetx's config.model, as JSON
  vocab_size: int = 512
  hidden_size: int = 256
  num_hidden_layers: int = 4
  num_attention_heads: int = 4
  head_dim: int = 64
  max_position_embeddings: int = 256
  tie_word_embeddings: bool = False
  bos_token_id: int | None = 0  # sparsetx's packed rows start with id 0
  eos_token_id: int | list[int] | None = 1
  pad_token_id: int | None = 0


__all__ = ["SparsetxConfig"]

"""A Pythia-70M-shaped dense GPT-NeoX model: parallel block, LayerNorm with bias, partial rotary.

d_model 512, 6 layers of 8 heads (64 each), GELU MLP 2048 wide with biases, rotary on 25% of each
head, untied embeddings, vocabulary 50,304 (GPT-NeoX tokenizer, padded), context 2048.
"""

from sparsetx import config as config_lib


def get_config():
  config = config_lib.default_config()
  config.model.update(
    vocab_size=50_304,
    d_model=512,
    n_layers=6,
    head_dim=64,
    max_len=2048,
    block="parallel",
    norm="layernorm",
    norm_eps=1e-5,
    use_bias=True,
    rotary_fraction=0.25,
    rope_base=10_000.0,
    tie_embeddings=False,
  )
  config.model.ffn.update(type="mlp", d_ffw=2048)
  return config

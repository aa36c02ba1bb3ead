"""Tiny CPU-sized model on the embedded corpus (the default job): `--config=configs/tiny.py[:ffn]`.

The optional argument picks the feed-forward type (default sgatlin) at a size that trains in
minutes on a laptop CPU: d_model 128, 4 layers of 2 heads, context 128, 300 steps of 16 x 128 tokens.
"""

from sparsetx import config as config_lib

TINY_FFN = {
  "mlp": dict(d_ffw=512),
  "swiglu": dict(d_ffw=384),
  "moe": dict(d_ffw=128, n_experts=8, experts_per_token=2),
  "peer": dict(d_ffw=32**2, n_channels=4, top_k=8, d_key=64),
  "sgatlin": dict(d_ffw=32**2, n_channels=4, top_k=8, d_key=64),
  "fff": dict(depth=4, n_trees=4),
}


def get_config(ffn_type: str = "sgatlin"):
  config = config_lib.default_config()
  config.model.update(d_model=128, n_layers=4, head_dim=64, max_len=128, vocab_size=512)
  if ffn_type not in TINY_FFN:
    raise config_lib.ConfigError(
      f"configs/tiny.py:{ffn_type} names an unknown feed-forward type; use one of {', '.join(TINY_FFN)}."
    )
  config.model.ffn.type = ffn_type
  config.model.ffn.update(TINY_FFN[ffn_type])
  config.data.update(seq_len=128, global_batch_size=16, eval_batch_size=16)
  config.train.update(steps=300, warmup_steps=30, log_every=20, eval_every=100, eval_batches=8)
  config.checkpoint.update(every=100, keep=3)
  return config

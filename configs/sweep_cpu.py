"""CPU isoflop sweeps (`python -m sparsetx.tools.sweep --base_config=configs/sweep_cpu.py --d_models=32,64`): the tiny
model family (configs/tiny.py:FFN) cut to a size whose runs train in seconds on a laptop CPU.

2 layers of 32-wide heads (so d_model 32 fits), context 32, batches of 8 x 32 tokens, float32, a 2-step
warmup, validation on the facts task (one batch). The sweep sets d_model and sizes the feed-forward
layer from it (sparsetx/measure/sweep.py); everything here is held equal across the types.
"""

import importlib.util
import os


def _tiny():
  spec = importlib.util.spec_from_file_location("tiny_config", os.path.join(os.path.dirname(__file__), "tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(ffn_type: str = "sgatlin"):
  config = _tiny().get_config(ffn_type)
  config.model.update(n_layers=2, head_dim=32, max_len=32, dtype="float32")
  config.data.update(seq_len=32, global_batch_size=8, eval_batch_size=8, shuffle_buffer=64, mixture=(("facts", 1.0),))
  config.train.update(warmup_steps=2, log_every=1, eval_every=1000, eval_batches=1)
  config.checkpoint.update(every=1000)
  return config

"""A rung of the sgatlin paper's scaling ladder: `--config=configs/ladder.py:sgatlin,4`.

d_model = 128 * scale, n_layers = 2 * scale, d_ffw per type (Listing 2; see sparsetx/models/ladder.py,
which also defines the FFF rung). GPT-2 vocabulary padded to 50,304, context 2048, remat per block.
"""

from sparsetx import config as config_lib
from sparsetx.models import ladder


def get_config(arg: str = "sgatlin,2"):
  parts = arg.split(",")
  if len(parts) != 2 or not parts[1].strip().isdigit():
    raise config_lib.ConfigError(
      f"configs/ladder.py:{arg} must be 'FFN,SCALE', e.g. configs/ladder.py:sgatlin,4 "
      f"(FFN one of {', '.join(config_lib.FFN_TYPES)}; SCALE 2..8 in the paper)."
    )
  config = config_lib.default_config()
  config.model = ladder.ladder_model_config(int(parts[1]), parts[0].strip())
  return config

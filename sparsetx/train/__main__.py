"""`python -m sparsetx.train --config=configs/tiny.py --workdir=DIR [--config.train.steps=200 ...]`.

Every config field can be overridden on the command line (ml_collections config_flags). A bad
config, mesh, batch size or workdir ends the run with one line naming the field and exit code 2.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from sparsetx.config import ConfigError

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config file, optionally with ':ARG'.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and TensorBoard logs.", required=True)


def main(argv):
  del argv
  from sparsetx.train.loop import NonFiniteLossError, train  # after flags: keeps --help fast

  try:
    train(_CONFIG.value, _WORKDIR.value)
  except ConfigError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
  except NonFiniteLossError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(3)
  logging.info("Done. Checkpoints: %s/checkpoints, TensorBoard: %s/tensorboard", _WORKDIR.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)

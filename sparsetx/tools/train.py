"""`sparsetx-train`: `python -m sparsetx.train` as an installed command (same flags; see sparsetx/train/__main__.py)."""

from sparsetx.train import __main__ as train_main


def main():
  """The `sparsetx-train` entry point."""
  train_main.main()


if __name__ == "__main__":
  main()

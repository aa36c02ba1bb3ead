"""`sparsetx-evaluate`: `python -m sparsetx.evaluate` as an installed command (same flags; see
sparsetx/evaluate/__main__.py)."""

from sparsetx.evaluate import __main__ as evaluate_main


def main():
  """The `sparsetx-evaluate` entry point."""
  evaluate_main.main()


if __name__ == "__main__":
  main()

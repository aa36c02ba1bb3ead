"""`python -m sparsetx.train`: the `sparsetx-train` program, sparsetx/tools/train.py."""

from sparsetx.tools import train

if __name__ == "__main__":
  train.main()

"""`python -m sparsetx.evaluate`: the `sparsetx-evaluate` program, sparsetx/tools/evaluate.py."""

from sparsetx.tools import evaluate

if __name__ == "__main__":
  evaluate.main()

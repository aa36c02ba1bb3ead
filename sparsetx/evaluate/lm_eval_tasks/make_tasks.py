"""Writes the local lm-eval tasks of this directory from the embedded corpus's fact table.

`python -m sparsetx.evaluate.lm_eval_tasks.make_tasks` rewrites them, deterministically.

More: docs/modules.md, sparsetx/evaluate/lm_eval_tasks/make_tasks.py.
"""

import json
import os
import random

from sparsetx.data import corpus

HERE = os.path.dirname(os.path.abspath(__file__))
DATA_FILE = os.path.join("sparsetx", "evaluate", "lm_eval_tasks", "facts.jsonl")  # from the repository root
CHOICES = 4
SEED = 0

_COMMON = """\
tag: sparsetx
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_file}
test_split: test
output_type: multiple_choice
doc_to_text: "The {{{{noun}}}} was"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def documents() -> list[dict]:
  table = corpus.facts()
  adjectives = [adjective for _, adjective in table]
  rng = random.Random(SEED)
  docs = []
  for i, (noun, adjective) in enumerate(table):
    choices = [adjective] + rng.sample(adjectives[:i] + adjectives[i + 1 :], CHOICES - 1)
    rng.shuffle(choices)
    docs.append(
      dict(
        noun=noun,
        adjective=adjective,
        label=i,
        choices=[f"{c}." for c in choices],
        choice_label=choices.index(adjective),
      )
    )
  return docs


def cloze_yaml() -> str:
  adjectives = json.dumps([f"{adjective}." for _, adjective in corpus.facts()])
  return (
    f"task: sparsetx_facts_cloze\n{_COMMON.format(data_file=DATA_FILE)}"
    f"doc_to_choice: {adjectives}\ndoc_to_target: label\n"
  )


def choice_yaml() -> str:
  return (
    f"task: sparsetx_facts_choice\n{_COMMON.format(data_file=DATA_FILE)}"
    "doc_to_choice: choices\ndoc_to_target: choice_label\n"
  )


def main():
  with open(os.path.join(HERE, "facts.jsonl"), "w") as f:
    for doc in documents():
      f.write(json.dumps(doc) + "\n")
  for name, text in (("sparsetx_facts_cloze.yaml", cloze_yaml()), ("sparsetx_facts_choice.yaml", choice_yaml())):
    with open(os.path.join(HERE, name), "w") as f:
      f.write(f"# Written by make_tasks.py from sparsetx.data.corpus.facts(); do not edit.\n{text}")


if __name__ == "__main__":
  main()

"""Local lm-evaluation-harness tasks (YAML + JSONL) built from the embedded corpus; see make_tasks.py."""

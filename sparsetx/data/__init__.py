"""Training data: SeqIO tasks and mixtures, vocabularies, an embedded corpus, a token store, one resumable stream.

One path: a task's documents are tokenized once into a token store (sparsetx-tokenize, or the trainer itself into
<workdir>/tokenized for a config without config.data.tokenized_dir), and the trainer reads rows of it.

More: docs/modules.md, sparsetx/data/__init__.py.
"""

from sparsetx.data.file_checks import check_files, check_training_files  # noqa: F401  (light: no TensorFlow)

"""Registers config.data's tasks and mixture with seqio, under names other seqio tools can use.

Every task runs the same chain after its source: text -> drop blank documents -> tokenize ->
append EOS -> split into pieces of at most seq_len tokens. `text_task` stops before tokenizing (whole documents as text,
which `sparsetx-tokenize` encodes in batches and stores). The registry is process-global and
the config is the source of truth, so registering replaces any earlier task of the same name
(a dataset already built keeps the task it was built from).
"""

import ml_collections
import seqio
import tensorflow as tf

from sparsetx.data import preprocessors, sources

TASK_PREFIX = "sparsetx."
MIXTURE_NAME = "sparsetx.mixture"


def task_name(name: str) -> str:
  """The seqio registry name of config task `name` (e.g. 'stories' -> 'sparsetx.stories')."""
  return TASK_PREFIX + name


def _document_preprocessors(to_targets: sources.Preprocessor) -> list:
  """Source records -> whole tokenized documents, each ending in EOS."""
  return [to_targets, preprocessors.drop_blank, seqio.preprocessors.tokenize, seqio.preprocessors.append_eos]


def register_task(name: str, data: ml_collections.ConfigDict, vocabulary: seqio.Vocabulary) -> seqio.Task:
  data_source, to_targets = sources.make_source(name, (data.sources or {}).get(name))
  full_name = task_name(name)
  seqio.TaskRegistry.remove(full_name)
  return seqio.TaskRegistry.add(
    full_name,
    source=data_source,
    preprocessors=[*_document_preprocessors(to_targets), preprocessors.split_to_length],
    output_features={"targets": seqio.Feature(vocabulary, add_eos=True)},
    shuffle_buffer_size=data.shuffle_buffer,
  )


def text_task(name: str, data: ml_collections.ConfigDict) -> seqio.Task:
  """Task `name`'s source and text extraction, blank documents dropped: the whole documents as text, which the
  tokenize job encodes in batches (encoders.py). Not registered (the trainer's task keeps its name)."""
  data_source, to_targets = sources.make_source(name, (data.sources or {}).get(name))
  text = seqio.Feature(seqio.PassThroughVocabulary(0), dtype=tf.string, rank=0, add_eos=False)
  return seqio.Task(
    task_name(name) + ".text",
    source=data_source,
    preprocessors=[to_targets, preprocessors.drop_blank],
    output_features={"targets": text},
    shuffle_buffer_size=None,
  )


def register_mixture(data: ml_collections.ConfigDict, vocabulary: seqio.Vocabulary) -> seqio.Mixture:
  """Registers every task of `config.data.mixture` and the mixture over them with their rates."""
  rates = [(task_name(name), float(rate)) for name, rate in data.mixture]
  for name, _ in data.mixture:
    register_task(name, data, vocabulary)
  seqio.MixtureRegistry.remove(MIXTURE_NAME)
  return seqio.MixtureRegistry.add(MIXTURE_NAME, rates)

"""The embedded corpus: a consistent fact table, stories that never contradict it, fixed output."""

import re

from sparsetx.data import corpus

FACT_RE = re.compile(r"The (\w+) was (\w+)\.")


def test_fact_table_is_a_bijection_between_nouns_and_adjectives():
  table = corpus.facts()
  nouns = [noun for noun, _ in table]
  adjectives = [adjective for _, adjective in table]
  assert len(table) == len(corpus.NOUNS) >= 64
  assert len(set(nouns)) == len(nouns)
  assert len(set(adjectives)) == len(adjectives)  # no two nouns share an adjective
  assert not set(nouns) & set(adjectives)


def test_every_fact_sentence_in_any_document_agrees_with_the_table():
  table = dict(corpus.facts())
  adjectives = set(table.values())
  seen = 0
  for split in corpus.SPLITS:
    for document in corpus.stories(split) + corpus.fact_documents(split):
      for noun, adjective in FACT_RE.findall(document):
        if noun in table or adjective in adjectives:
          assert table.get(noun) == adjective, (noun, adjective, document)
          seen += 1
  assert seen > 20_000


def test_fact_documents_are_only_fact_sentences_and_validation_lists_each_fact_once():
  for document in corpus.fact_documents("train")[:2000]:
    assert FACT_RE.sub("", document).strip() == ""
  validation = corpus.fact_documents("validation")
  assert list(validation) == [corpus.fact_sentence(n, a) for n, a in corpus.facts()]


def test_characters_always_appear_as_the_same_animal():
  cast = {member["name"]: member["animal"] for member in corpus.characters()}
  pattern = re.compile(r"\b(" + "|".join(cast) + r") the (\w+)")
  pairs = {pair for story in corpus.stories("train") for pair in pattern.findall(story)}
  assert pairs and all(cast[name] == animal for name, animal in pairs)


def test_corpus_is_deterministic_small_and_splits_differ():
  # Regenerate with the caches cleared: the text must not depend on process state.
  first = corpus.stories("train")[:50]
  corpus.stories.cache_clear()
  corpus.facts.cache_clear()
  assert corpus.stories("train")[:50] == first
  size = sum(len(d) for s in corpus.SPLITS for d in corpus.stories(s) + corpus.fact_documents(s))
  assert 1_000_000 < size < 5_000_000
  assert not set(corpus.stories("train")) & set(corpus.stories("validation"))

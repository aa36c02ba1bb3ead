"""Nearest circuits: for each token of a new sentence, the database circuits closest in cosine distance
(sgatlin paper Sec. 4.2, Fig. 6 and the extended neighbours table).

Similar circuits that fire for semantically related tokens (names near names, animals near animals)
are the paper's evidence that the circuit space is structured; a large distance to every neighbour
says the circuit was not seen before.
"""

import dataclasses

import numpy as np

from sparsetx.interp import circuits as circuits_lib
from sparsetx.interp.checkpoint import token_text as _token_text


def token_text(vocabulary, token_id) -> str:
  """A token for a markdown cell ('|' escaped)."""
  return _token_text(vocabulary, token_id).replace("|", "\\|")


@dataclasses.dataclass
class Neighbours:
  tokens_Q: np.ndarray  # the sentence's input tokens
  index_QK: np.ndarray  # database rows of the k nearest circuits, nearest first
  distance_QK: np.ndarray  # their cosine distances
  layer: int


def nearest(model, db: circuits_lib.CircuitDatabase, tokens_T, layer: int, k: int = 10) -> Neighbours:
  """The k nearest database circuits of every token of one sentence (ids [T]) at `layer`."""
  cfg = model.cfg
  units, weights = circuits_lib.circuit_names(cfg, layer)
  out = model.trace(np.asarray(tokens_T)[None], [units, weights])
  ids_QS, w_QS = circuits_lib.sparse_circuit(cfg, np.asarray(out[units])[0], np.asarray(out[weights])[0])
  distance_QN = circuits_lib.cosine_distances(cfg, ids_QS, w_QS, db.ids(layer), db.weights(layer))
  index_QK = np.argsort(distance_QN, axis=1, kind="stable")[:, :k]
  return Neighbours(np.asarray(tokens_T), index_QK, np.take_along_axis(distance_QN, index_QK, 1), layer)


def format_table(vocabulary, db: circuits_lib.CircuitDatabase, neighbours: Neighbours) -> str:
  """Markdown: a column per sentence token; cell r = r-th nearest circuit's input token and distance."""
  head = [token_text(vocabulary, t) for t in neighbours.tokens_Q]
  lines = ["| rank | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
  for r in range(neighbours.index_QK.shape[1]):
    cells = [
      f"{token_text(vocabulary, db.tokens_N[j])} {d:.2f}"
      for j, d in zip(neighbours.index_QK[:, r], neighbours.distance_QK[:, r])
    ]
    lines.append(f"| {r + 1} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def format_extended(vocabulary, db: circuits_lib.CircuitDatabase, neighbours: Neighbours, per_token: int = 3) -> str:
  """Markdown, one row per (sentence token, neighbour): the neighbour's context, input token,
  distance and the model's top-5 predictions there (the paper's extended table)."""
  text = lambda ids: "".join(token_text(vocabulary, i) for i in ids if i >= 0)
  lines = ["| token | rank | distance | context [input] | top-5 predictions |", "|---|---|---|---|---|"]
  for q, token in enumerate(neighbours.tokens_Q):
    for r in range(min(per_token, neighbours.index_QK.shape[1])):
      j = neighbours.index_QK[q, r]
      preds = " ".join(token_text(vocabulary, i) for i in db.top5_N5[j])
      lines.append(
        f"| {token_text(vocabulary, token)} | {r + 1} | {neighbours.distance_QK[q, r]:.3f} | "
        f"{text(db.context_NW[j])}[{token_text(vocabulary, db.tokens_N[j])}] | {preds} |"
      )
  return "\n".join(lines)

"""A 2-D map of the circuits of the most frequent input tokens, coloured by token (sgatlin paper Fig. 5).

UMAP with the cosine metric when `umap-learn` is installed (the paper's choice); otherwise PCA of the
unit-normalized circuits (numpy SVD), which keeps the cosine geometry's main directions. Clusters of
circuits shared by related tokens (punctuation, names and pronouns) are what to look for.
"""

import dataclasses

import numpy as np

from sparsetx import paths
from sparsetx.interp import circuits as circuits_lib
from sparsetx.interp.checkpoint import token_text


@dataclasses.dataclass
class Embedding:
  points_N2: np.ndarray
  tokens_N: np.ndarray  # the input token of each point
  method: str  # "umap" | "pca"
  layer: int


def frequent_token_rows(db: circuits_lib.CircuitDatabase, n_tokens: int, per_token: int, seed: int = 0) -> np.ndarray:
  """Database rows of the `n_tokens` most frequent input tokens, at most `per_token` each."""
  values, counts = np.unique(db.tokens_N, return_counts=True)
  top = values[np.argsort(-counts, kind="stable")[:n_tokens]]
  rng = np.random.default_rng(seed)
  rows = []
  for token in top:
    where = np.flatnonzero(db.tokens_N == token)
    rows.append(np.sort(rng.choice(where, min(per_token, len(where)), replace=False)))
  return np.concatenate(rows)


def pca_2d(x_NU: np.ndarray) -> np.ndarray:
  centred = x_NU - x_NU.mean(0)
  _, _, vt = np.linalg.svd(centred, full_matrices=False)
  return centred @ vt[:2].T


def embed(
  cfg,
  db: circuits_lib.CircuitDatabase,
  layer: int,
  n_tokens: int = 20,
  per_token: int = 40,
  method: str = "auto",
  seed: int = 0,
) -> Embedding:
  rows = frequent_token_rows(db, n_tokens, per_token, seed)
  dense = circuits_lib.densify(cfg, db.ids(layer)[rows], db.weights(layer)[rows])
  dense /= np.maximum(np.linalg.norm(dense, axis=1, keepdims=True), 1e-12)
  if method in ("auto", "umap"):
    try:
      import umap  # optional: umap-learn
    except ImportError:
      if method == "umap":
        raise
    else:
      points = umap.UMAP(n_components=2, metric="cosine", random_state=seed).fit_transform(dense)
      return Embedding(np.asarray(points), db.tokens_N[rows], "umap", layer)
  return Embedding(pca_2d(dense), db.tokens_N[rows], "pca", layer)


def plot(vocabulary, embedding: Embedding, path: str) -> None:
  """Scatter PNG, one colour per input token, legend with the tokens."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tokens = list(dict.fromkeys(embedding.tokens_N.tolist()))
  colours = plt.get_cmap("tab20")(np.linspace(0, 1, max(len(tokens), 1)))
  fig, ax = plt.subplots(figsize=(9, 6))
  for colour, token in zip(colours, tokens):
    at = embedding.tokens_N == token
    ax.scatter(*embedding.points_N2[at].T, s=9, color=colour, label=repr(token_text(vocabulary, token)))
  ax.set_title(f"layer {embedding.layer} circuits of the {len(tokens)} most frequent tokens ({embedding.method})")
  ax.set_xlabel(f"{embedding.method} component 1")
  ax.set_ylabel(f"{embedding.method} component 2")
  ax.ticklabel_format(useOffset=False)
  # Outside the axes, to their right: a legend inside would cover points.
  ax.legend(title="input token", fontsize=7, ncol=2, markerscale=2, loc="upper left", bbox_to_anchor=(1.02, 1.0))
  fig.tight_layout()
  paths.save_figure(fig, path)
  plt.close(fig)

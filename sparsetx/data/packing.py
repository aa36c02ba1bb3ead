"""Model features of rows cut from a token stream (`token_store.Rows`), packed exactly as seqio packs.

A row holds consecutive pieces of documents; each piece is its own segment: segment ids 1, 2, ... in
order, positions restarting at 0, and inputs the targets shifted right with 0 at each piece's start
(seqio's `autoregressive_inputs`), so attention and the loss never cross a document boundary. A row cut
from a stream has no padding: every token is a target.
"""

import numpy as np

from sparsetx.data import token_store


def packed_features(rows: token_store.Rows) -> dict[str, np.ndarray]:
  """The FEATURES of sparsetx.data.batches for `rows`, each [N, T]."""
  targets_NT, starts_NT = rows.tokens_NT, rows.starts_NT
  n, t = targets_NT.shape
  index_NT = np.broadcast_to(np.arange(t, dtype=np.int32), (n, t))
  piece_start_NT = np.maximum.accumulate(np.where(starts_NT, index_NT, 0), axis=1)
  inputs_NT = np.zeros_like(targets_NT)
  inputs_NT[:, 1:] = targets_NT[:, :-1]
  return dict(
    inputs=np.where(starts_NT, 0, inputs_NT).astype(np.int32),
    targets=targets_NT.astype(np.int32),
    segment_ids=np.cumsum(starts_NT, axis=1, dtype=np.int32),
    positions=(index_NT - piece_start_NT).astype(np.int32),
    loss_weights=np.ones((n, t), np.float32),
  )

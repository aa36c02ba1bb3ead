"""A process's rows of the global batch, and the global jax.Array batch assembled from every process's rows.

A batch is a dict of [global_batch_size, seq_len] arrays, FEATURES (packing.py builds them from token rows).

More: docs/modules.md, sparsetx/data/batches.py.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FEATURES = ("inputs", "targets", "segment_ids", "positions", "loss_weights")


class Shard(NamedTuple):
  """Block `index` of `count` equal blocks of batch rows."""

  index: int
  count: int


def abstract_batch(config, sharding) -> dict:
  """The global batch as abstract arrays (shapes, dtypes, `sharding`): what the step is traced and compiled for."""
  B, T = config.data.global_batch_size, config.data.seq_len
  spec = lambda dtype: jax.ShapeDtypeStruct((B, T), dtype, sharding=sharding)  # noqa: E731
  return dict(
    inputs=spec(jnp.int32),
    targets=spec(jnp.int32),
    segment_ids=spec(jnp.int32),
    positions=spec(jnp.int32),
    loss_weights=spec(jnp.float32),
  )


def data_shard(batch_sharding: jax.sharding.Sharding, global_batch_size: int) -> tuple[Shard, int]:
  """This process's block of batch rows and its row count, from the rows its devices hold."""
  index_map = batch_sharding.addressable_devices_indices_map((global_batch_size,))
  rows = set()
  for index in index_map.values():
    rows.update(range(*index[0].indices(global_batch_size)))
  local_rows = len(rows)
  first = min(rows)
  if rows != set(range(first, first + local_rows)) or global_batch_size % local_rows or first % local_rows:
    raise ValueError(
      f"batch_sharding gives this process rows {sorted(rows)[:8]}... of config.data.global_batch_size="
      f"{global_batch_size}, not one contiguous block of equal size; shard the batch axis over whole processes."
    )
  return Shard(first // local_rows, global_batch_size // local_rows), local_rows


def global_batch(
  local: dict[str, np.ndarray], sharding: jax.sharding.Sharding, global_rows: int
) -> dict[str, jax.Array]:
  """The global batch whose rows this process holds `local` of."""
  return {
    k: jax.make_array_from_process_local_data(sharding, local[k], (global_rows,) + local[k].shape[1:]) for k in FEATURES
  }

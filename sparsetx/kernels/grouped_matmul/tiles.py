"""Row tiles of a grouped matmul: rows sorted by group, cut so that no tile mixes two groups' rows.

A tile is `tile` consecutive rows starting at a multiple of `tile`; a block of rows that straddles a group boundary
is visited once per group it holds, each visit computing only that group's rows (megablox's layout). So the
number of tiles is at most cdiv(n_rows, tile) + n_groups - 1, a static bound, and every row is computed by
exactly one tile: the work is the routed rows plus at most one partial tile per group, never groups x rows.
"""

import jax.numpy as jnp


def n_tiles(n_rows: int, n_groups: int, tile: int) -> int:
  """The static bound on the tiles of any split of n_rows rows into n_groups groups."""
  return -(-n_rows // tile) + n_groups - 1


def row_tiles(group_sizes_E, n_rows: int, tile: int):
  """(group_T, block_T, lo_T, hi_T) int32 for the n_tiles(...) tiles: tile t computes rows [lo_T[t], hi_T[t]) of
  group group_T[t], all inside row block block_T[t] (rows [block * tile, block * tile + tile)). Tiles past the
  groups' rows compute no row (lo = hi) and name the last group and block 0, so every index stays in range."""
  E = group_sizes_E.shape[0]
  sizes_E = group_sizes_E.astype(jnp.int32)
  ends_E = jnp.cumsum(sizes_E)
  starts_E = ends_E - sizes_E
  first_E = starts_E // tile
  count_E = jnp.where(sizes_E > 0, (ends_E - 1) // tile - first_E + 1, 0)
  tile_ends_E = jnp.cumsum(count_E)
  t_T = jnp.arange(n_tiles(n_rows, E, tile), dtype=jnp.int32)
  group_T = jnp.searchsorted(tile_ends_E, t_T, side="right").astype(jnp.int32)
  used_T = group_T < E
  group_T = jnp.minimum(group_T, E - 1)
  block_T = jnp.where(used_T, first_E[group_T] + t_T - (tile_ends_E - count_E)[group_T], 0)
  lo_T = jnp.where(used_T, jnp.maximum(starts_E[group_T], block_T * tile), 0)
  hi_T = jnp.where(used_T, jnp.minimum(ends_E[group_T], block_T * tile + tile), 0)
  return group_T, block_T.astype(jnp.int32), lo_T.astype(jnp.int32), hi_T.astype(jnp.int32)

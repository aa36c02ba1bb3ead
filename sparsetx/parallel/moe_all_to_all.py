"""MoE's token dispatch: each (token, expert) pair sent to its expert's device by a ragged all-to-all, the experts
applied there, and the outputs sent back."""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from sparsetx.config.placements import EXPERT
from sparsetx.kernels import platform
from sparsetx.parallel import expert_groups
from sparsetx.parallel.own_tokens import on_own_tokens, on_own_units


def expert_dispatch(
  experts_fn,
  sorted_fn,
  x_BTD,
  ids_BTA,
  weights_BTA,
  tables,
  *,
  table_axes,
  placement=EXPERT,
  table_names=None,
):
  """y [B, T, D] (x's dtype): the experts over the tokens routed to each, the experts split over their group.

  experts_fn(x_ND, ids_NA, weights_NA, *tables, first_expert=0) -> y_ND computes the given experts (ids
  first_expert.. onwards; pairs routed elsewhere contribute nothing): the plain computation. sorted_fn(x_SD,
  group_sizes_E, *tables) -> y_SD (float32) runs the given experts on rows sorted by expert. `tables` have the
  experts first (logical name table_axes[0]). On a mesh whose expert axes split the batch, each token goes to the
  devices of its k experts and back (`all_to_all_experts`); an expert axis that does not split the batch holds the
  same tokens on every device, so each runs experts_fn on them for its own experts and the outputs are summed.
  Placements fsdp and data, and an expert axis of one device: every expert on every device (`on_own_tokens`), the
  tables stored with `table_names` (each table's logical names as the layer gives them; default table_axes for
  each) as placed, so each device sorts and computes only its own tokens' pairs.
  """
  B, T, D = x_BTD.shape
  A = ids_BTA.shape[-1]
  flat = (x_BTD.reshape(B * T, D), ids_BTA.reshape(B * T, A), weights_BTA.reshape(B * T, A))
  group = None
  if not placement.whole_on_device:
    group = expert_groups.expert_group(
      table_axes[0], expert_groups.whole_units(tables[0].shape[0], table_axes[0]), B * T
    )
  if group is None:  # every expert on every device: each sorts and computes its own tokens' pairs
    names = tuple(placement.stored_names(n) for n in (table_names or (table_axes,) * len(tables)))
    (y_ND,) = on_own_tokens(lambda *args: (experts_fn(*args),), flat, tuple(tables), names)
    return y_ND.reshape(B, T, D)
  experts = PartitionSpec(group.unit_spec)
  if all(a in group.batch for a in group.units):
    y_ND = expert_groups.shard_map(
      functools.partial(all_to_all_experts, sorted_fn, group),
      group,
      in_specs=(group.token_spec,) * 3 + (experts,) * len(tables),
      out_specs=group.token_spec,
      every_axis=True,
    )(*flat, *tables)
    return y_ND.reshape(B, T, D)

  def local(tokens_g, _, tables_e):
    first = tables_e[0].shape[0] * expert_groups.unit_index(group)
    return (experts_fn(*tokens_g, *tables_e, first_expert=first),)

  (y_ND,) = on_own_units(
    group, local, tokens=flat, tables=tuple(tables), table_specs=(experts,) * len(tables), out_dtype=x_BTD.dtype
  )
  return y_ND.reshape(B, T, D).astype(x_BTD.dtype)


def all_to_all_experts(sorted_fn, group, x_nD, ids_nA, weights_nA, *tables_e):
  """Inside the shard_map: y [n, D] (x's dtype) for this device's n tokens, each sent only to its k experts' devices.

  The n·k (token, slot) pairs are sorted by expert, so by owner (experts are split over the group's unit axes in
  order, e = X/G per device); one all-gather of every device's per-expert pair counts (G·X int32) gives the sizes
  and offsets of a ragged all-to-all that sends each pair's x row to its expert's device. Each device sorts what
  it received by its own experts, runs them (sorted_fn, dropless: the buffer holds G·n·k rows, every pair of
  the group could pick this device), and sends each row's output back by the reverse ragged all-to-all, in x's
  dtype: every pair's output travels alone and the k of a token are weighted and summed in float32 at its owner,
  so nothing is summed on the wire. docs/expert_parallel.md has the bytes.
  """
  n, D = x_nD.shape
  A = ids_nA.shape[1]
  e = tables_e[0].shape[0]
  G = group.n_unit_shards
  X, S, R = e * G, n * A, G * n * A
  axes = group.units
  me = expert_groups.unit_index(group)
  expert_S = ids_nA.reshape(S)
  order_S = jnp.argsort(expert_S, stable=True)
  counts_X = jnp.bincount(expert_S, length=X).astype(jnp.int32)
  counts_GX = jax.lax.all_gather(counts_X, axes)  # [source device, expert]: the pairs each device routes to each
  sizes_GG = counts_GX.reshape(G, G, e).sum(-1)  # [source, destination]
  send_G = sizes_GG[me]
  recv_G = sizes_GG[:, me]
  start_GG = jnp.cumsum(sizes_GG, axis=1) - sizes_GG  # where source i's rows for j start in i's sorted pairs
  land_GG = jnp.cumsum(sizes_GG, axis=0) - sizes_GG  # where source i's rows land in j's receive buffer
  x_RD = ragged_all_to_all(
    x_nD[order_S // A], jnp.zeros((R, D), x_nD.dtype), start_GG[me], send_G, land_GG[me], recv_G, axes
  )
  # Received: by source, then by expert. Each row's local expert, from the counts; padding sorts last.
  counts_Ge = jax.lax.dynamic_slice_in_dim(counts_GX, me * e, e, axis=1)
  segment_R = jnp.searchsorted(jnp.cumsum(counts_Ge.reshape(G * e)), jnp.arange(R, dtype=jnp.int32), side="right")
  local_R = jnp.where(segment_R < G * e, segment_R % e, e)
  order_R = jnp.argsort(local_R, stable=True)
  y_RD = sorted_fn(x_RD[order_R], counts_Ge.sum(0), *tables_e)[jnp.argsort(order_R)].astype(x_nD.dtype)
  y_SD = ragged_all_to_all(y_RD, jnp.zeros((S, D), x_nD.dtype), land_GG[:, me], recv_G, start_GG[:, me], send_G, axes)
  y_nAD = y_SD[jnp.argsort(order_S)].reshape(n, A, D)
  return jnp.einsum("nad,na->nd", y_nAD, weights_nA.astype(jnp.float32), preferred_element_type=jnp.float32).astype(
    x_nD.dtype
  )


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes):
  """`jax.lax.ragged_all_to_all` over `axes` on GPU and TPU; on a CPU, which has no such op (XLA:CPU's thunk emitter
  refuses it), the same result by a padded all-to-all: each destination's rows in a block of min(operand rows,
  output rows) (no destination sends or receives more), so G blocks travel however few rows are real."""
  if not platform.on_cpu():
    return jax.lax.ragged_all_to_all(
      operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axes
    )
  G = send_sizes.shape[0]
  cap = min(operand.shape[0], output.shape[0])
  rows_GC = jnp.arange(cap, dtype=jnp.int32)[None, :]
  real_GC = rows_GC < send_sizes[:, None]
  take_GC = jnp.minimum(input_offsets[:, None] + rows_GC, operand.shape[0] - 1)
  blocks_GCD = jnp.where(real_GC[:, :, None], operand[take_GC], jnp.zeros((), operand.dtype))
  blocks_GCD = jax.lax.all_to_all(blocks_GCD, axes, 0, 0, tiled=True)  # block i: from source i
  land_G = jax.lax.all_to_all(output_offsets, axes, 0, 0, tiled=True)  # where source i's rows go in mine
  put_GC = jnp.where(rows_GC < recv_sizes[:, None], land_G[:, None] + rows_GC, output.shape[0])  # out of range: dropped
  return output.at[put_GC.reshape(G * cap)].set(blocks_GCD.reshape(G * cap, -1), mode="drop")

"""The sparse layers' table computations in the form their placement gives: the gated gather over a neuron table
(whole, split by unit, or with d_model split too) and the FFF tree walk. A layer hands its arrays and its table's
logical axes; the mesh and rules in the context (logical_rules.activate) decide the form."""

import jax.numpy as jnp
from jax.sharding import PartitionSpec

from sparsetx.config.placements import EXPERT, Placement
from sparsetx.kernels.fff.tree_route import sparse_forward
from sparsetx.kernels.rows.gated_gather import gated_gather
from sparsetx.parallel import expert_collectives, expert_groups
from sparsetx.parallel.own_tokens import on_own_tokens, on_own_units
from sparsetx.parallel.tables import NeuronTable


def neuron_table_gather(
  table: NeuronTable, x_BTD, experts_2UFD, idx_BTUK, gates_BTUK, activation, options, gate_inside_activation=True
):
  """y [B, T, D] (x's dtype): sum_u sum_k a(<w_in[u, i], x>, g) * w_out[u, i], i = idx[.., u, k], g = gates[.., u, k].

  The slot coefficient a is act(g * h) (`gate_inside_activation`, sgatlin) or g * act(h) (PEER), as the gated
  gather's. experts [2, U, F, D] holds the in and out tables of U units (U = 1 for a shared table); `options`
  is a KernelOptions. Runs plain, with the units split over their expert group, or with d_model split too,
  as `table`'s layout under the active rules gives.
  """
  B, T, D = x_BTD.shape
  U, K = idx_BTUK.shape[2:]  # the units of the routing: the table may be this device's block (`table_param`)
  group = table.layout(B * T)
  if group is None:
    return _whole_table_gather(
      table, x_BTD, experts_2UFD, idx_BTUK, gates_BTUK, activation, options, gate_inside_activation
    )
  if group.split:
    x_ND, idx_NUK, gates_NUK = x_BTD.reshape(B * T, D), idx_BTUK.reshape(B * T, U, K), gates_BTUK.reshape(B * T, U, K)
    y_ND = split_gated_gather(
      group, x_ND, experts_2UFD, idx_NUK, gates_NUK, activation, options, gate_inside_activation=gate_inside_activation
    )
    return y_ND.reshape(B, T, D)
  return _unit_split_gather(group, x_BTD, experts_2UFD, idx_BTUK, gates_BTUK, activation, options)


def _whole_table_gather(table, x_BTD, experts_2UFD, idx_BTUK, gates_BTUK, activation, options, gate_inside_activation):
  """The fsdp and data placements, and the expert placement without an expert group (no mesh, a unit axis of size
  1, tokens that don't split): the single-device gated gather on each device's own tokens, the table whole."""
  B, T, D = x_BTD.shape
  U, K = idx_BTUK.shape[2:]
  names = table.stored_axes
  if table.unit_axis is None:  # a shared table [2, F, D] enters as one unit [2, 1, F, D]
    names = names[:1] + (None,) + names[1:]

  def local(x_nD, idx_nUK, gates_nUK, experts_2UFD):
    return (_own_units_gather(x_nD, idx_nUK, gates_nUK, experts_2UFD, activation, options, gate_inside_activation),)

  flat = (x_BTD.reshape(B * T, D), idx_BTUK.reshape(B * T, U, K), gates_BTUK.reshape(B * T, U, K))
  (y_ND,) = on_own_tokens(local, flat, (experts_2UFD,), (names,))
  return y_ND.reshape(B, T, D)


def _own_units_gather(
  x_nD, idx_nuK, gates_nuK, experts_2uFD, activation, options, gate_inside_activation=True, sum_axes=()
):
  """The single-device gated gather over the u units a device holds (experts [2, u, F, D]): unit j's neurons are
  rows j F .. (j + 1) F - 1 of the units' tables stacked. With `sum_axes` D is a d-slice (the d-split)."""
  u, F, D = experts_2uFD.shape[1:]
  K = idx_nuK.shape[-1]
  rows_nS = (idx_nuK + F * jnp.arange(u, dtype=idx_nuK.dtype)[None, :, None]).reshape(-1, u * K)
  return gated_gather(
    x_nD,
    experts_2uFD[0].reshape(u * F, D),
    experts_2uFD[1].reshape(u * F, D),
    rows_nS,
    gates_nuK.reshape(rows_nS.shape),
    activation,
    options=options,
    gate_inside_activation=gate_inside_activation,
    sum_axes=sum_axes,
  )


def _unit_split_gather(group, x_BTD, experts_2UFD, idx_BTUK, gates_BTUK, activation, options):
  """The gated gather with its units (sgatlin's channels) split over the group: each device its own units."""
  B, T, D = x_BTD.shape
  U, K = idx_BTUK.shape[2:]

  def local(tokens_g, owned_g, tables_u):
    (x_gD,), (idx_guK, gates_guK), (experts_2uFD,) = tokens_g, owned_g, tables_u
    return (_own_units_gather(x_gD, idx_guK, gates_guK, experts_2uFD, activation, options),)

  (y_ND,) = on_own_units(
    group,
    local,
    tokens=(x_BTD.reshape(B * T, D),),
    owned=(idx_BTUK.reshape(B * T, U, K), gates_BTUK.reshape(B * T, U, K)),
    tables=(experts_2UFD,),
    table_specs=(PartitionSpec(None, group.unit_spec),),
    out_dtype=x_BTD.dtype,
  )
  return y_ND.reshape(B, T, D).astype(x_BTD.dtype)


def split_gated_gather(group, x_ND, experts_2UFD, idx_NUK, gates_NUK, activation, options, gate_inside_activation=True):
  """A neuron table's gated gather with its units and its d_model split over the group, in one shard_map.

  Each device holds experts[:, u-block, :, d-slice] (`expert_groups.table_group`) and never sends it. Inside
  `on_own_units`, x goes to the devices of its d-group by d-slice and the indices and gates are
  all-gathered over it; the gated gather with `sum_axes` (kernels/rows/sliced_gather.py) sums the partial dots over
  the d-group before the activation and the gate; y's d-slices come back by the inverse of x's move. Returns
  y [N, D] in x's dtype.
  """
  N, D = x_ND.shape
  U, K = idx_NUK.shape[1:]
  dtype = x_ND.dtype

  def local(tokens_g, owned_g, tables_u):
    (x_gD,), (idx_guK, gates_guK), (experts_2uFd,) = tokens_g, owned_g, tables_u
    x_hd = expert_collectives.to_owners(
      x_gD, group, unit_dim=1, axes=group.split
    )  # d-slices: their owners are the split axes
    idx_huK, gates_huK = _gather_over_slices(idx_guK, group), _gather_over_slices(gates_guK, group)
    y_hd = _own_units_gather(
      x_hd, idx_huK, gates_huK, experts_2uFd, activation, options, gate_inside_activation, sum_axes=group.split
    )
    # Summed over the units in float32 (`expert_collectives.scatter_back`); with no unit axes the sum is nothing and y moves in x's dtype.
    return (
      expert_collectives.from_owners(
        y_hd.astype(jnp.float32 if group.units else dtype), group, unit_dim=1, axes=group.split
      ),
    )

  (y_ND,) = on_own_units(
    group,
    local,
    tokens=(x_ND,),
    owned=(idx_NUK.reshape(N, U, K), gates_NUK.reshape(N, U, K)),
    tables=(experts_2UFD,),
    table_specs=(PartitionSpec(None, group.unit_spec, None, group.split_spec),),
  )
  return y_ND.astype(dtype)


def _gather_over_slices(a_g, group):
  """Per-token routing data of the whole d-group: all-gather over the split axes that split the batch."""
  return expert_collectives.all_gather(a_g, tuple(a for a in group.split if a in group.batch))


def tree_walk(
  x_BTD,
  w_in_PZD,
  b_in_PZ,
  w_out_PZD,
  depth: int,
  activation,
  options,
  *,
  table_axes,
  placement: Placement = EXPERT,
  bias_axes=("tree", "node"),
):
  """FFF's sparse forward: (y [B, T, D], path nodes [B, T, P, L], their logits [B, T, P, L]).

  Placement expert: the trees (the tables' first dimension, logical name table_axes[0]) split over their expert
  group when the mesh has one: each device walks its own trees for the group's tokens (routing never leaves a
  tree), y is summed back to the tokens' owners in float32, the paths and logits return by all-to-all. fsdp and
  data: every tree on every device (`on_own_tokens`), the tables (`table_axes`, b_in's `bias_axes`) as placed.
  """
  B, T, D = x_BTD.shape
  P, L = w_in_PZD.shape[0], depth + 1
  x_ND = x_BTD.reshape(B * T, D)
  # the expert placement's tables may be blocks (`table_param`)
  group = (
    None
    if placement.whole_on_device
    else expert_groups.expert_group(table_axes[0], expert_groups.whole_units(P, table_axes[0]), B * T)
  )
  if group is None:  # every tree on each device's own tokens (for expert: no mesh, trees or tokens that don't split)
    names = tuple(placement.stored_names(n) for n in (table_axes, bias_axes, table_axes))
    y_ND, path_NPL, z_NPL = on_own_tokens(
      lambda x_nD, *tables: sparse_forward(x_nD, *tables, depth, activation, options),
      (x_ND,),
      (w_in_PZD, b_in_PZ, w_out_PZD),
      names,
    )
    return y_ND.reshape(B, T, D), path_NPL.reshape(B, T, P, L), z_NPL.reshape(B, T, P, L)

  def local(tokens_g, _, tables_p):
    return sparse_forward(tokens_g[0], *tables_p, depth, activation, options)

  trees = PartitionSpec(group.unit_spec)
  y_ND, path_NPL, z_NPL = on_own_units(
    group,
    local,
    tokens=(x_ND,),
    tables=(w_in_PZD, b_in_PZ, w_out_PZD),
    table_specs=(trees,) * 3,
    n_owned_outputs=2,
  )
  P = expert_groups.whole_units(P, table_axes[0])
  return y_ND.reshape(B, T, D), path_NPL.reshape(B, T, P, L), z_NPL.reshape(B, T, P, L)

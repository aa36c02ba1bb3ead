"""Running a function on each device's own tokens: the tokens' layout, and the shard_maps that take the tokens
where they are and the tables as placed."""

import jax
from jax.sharding import PartitionSpec

from sparsetx.parallel import expert_collectives, expert_groups, logical_rules, per_device
from sparsetx.parallel.tables import NeuronTable


def keep_on_token_shards(a_BT, table: NeuronTable):
  """a [B, T, ...] constrained to the tokens' (batch) layout when the layer runs on a mesh, so its router runs where
  the tokens are (else the compiler may follow the router's sharded keys and gather every score everywhere)."""
  B, T = a_BT.shape[:2]
  group = _token_group(B * T) if table.placement.whole_on_device else table.layout(B * T)
  if group is None or not any(spec := per_device.free_spec(group.token_spec, group.mesh)):
    return a_BT
  a_N = a_BT.reshape((B * T,) + a_BT.shape[2:])
  a_N = jax.lax.with_sharding_constraint(a_N, jax.sharding.NamedSharding(group.mesh, spec))
  return a_N.reshape(a_BT.shape)


def _token_group(n_tokens: int):
  """An ExpertGroup of the batch axes alone (no units), or None with no mesh or tokens that don't split."""
  mesh = jax.sharding.get_abstract_mesh()
  if per_device.no_mesh(mesh):
    return None
  group = expert_groups.ExpertGroup(mesh, logical_rules.active_mesh_axes(mesh, "batch"), ())
  if not group.batch or n_tokens % group.n_token_shards:
    return None
  return group


def on_own_tokens(fn, tokens, tables, table_names):
  """fn(*tokens_n, *whole tables) on each device's own tokens: the fsdp and data placements, in one shard_map.

  `tokens` are [N, ...] arrays split like the batch; `tables` are stored as their logical names `table_names`
  give under the rules (as their placement stores them): a dimension split over batch axes (fsdp) is all-gathered whole here,
  minor axis first so the blocks land in order, and its gradient comes back by the transpose, a reduce-scatter;
  a replicated table (data) enters as it is, and the shard_map's transpose all-reduces its gradient. fn returns
  a tuple of [n, ...] arrays; they come back as [N, ...]. Every free mesh axis is manual inside
  (`per_device.every_axis_manual`): fn may call kernels, which are single-device ops. Tokens that don't split evenly over
  the batch axes (a batch of 1 at init) enter whole on every device. With no mesh, or every axis manual already,
  fn runs as it is.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if per_device.no_mesh(mesh):
    return fn(*tokens, *tables)
  rules, manual = logical_rules.active_rules(), per_device.manual_axes(mesh)
  batch = tuple(a for a in logical_rules.active_mesh_axes(mesh, "batch") if a not in manual)
  split = [
    [
      logical_rules.sized_axes(mesh, entry)
      for entry in per_device.free_spec(logical_rules.table_spec(names, rules), mesh)
    ]
    for names in table_names
  ]
  specs = [PartitionSpec(*(dims or None for dims in table_dims)) for table_dims in split]
  axes = set(batch) | {a for dims in split for axis_tuple in dims for a in axis_tuple}
  free = set(mesh.axis_names) - set(manual)
  # One device, or no manual region around with every free axis of size 1 (inside one, a kernel still needs
  # every axis manual), or every axis manual already: fn runs as it is.
  if not free or not (manual or any(mesh.shape[a] > 1 for a in free)):
    return fn(*tokens, *tables)
  if tokens[0].shape[0] % per_device.shards(mesh, batch):
    batch = ()  # whole on every device

  def body(*args):
    tokens_n, shards = args[: len(tokens)], args[len(tokens) :]
    whole = []
    for shard, dims in zip(shards, split):
      for dim, dim_axes in enumerate(dims):
        for axis in reversed(dim_axes):
          shard = jax.lax.all_gather(shard, axis, axis=dim, tiled=True)
      whole.append(shard)
    return tuple(fn(*tokens_n, *whole))

  token_spec = PartitionSpec(batch or None)
  # out_specs: a prefix of fn's tuple, every output split like the tokens
  free, in_specs, out_spec = per_device.every_axis_manual(
    mesh, axes, (token_spec,) * len(tokens) + tuple(specs), token_spec
  )
  return per_device.shard_map(body, mesh, in_specs, out_spec, free)(*tokens, *tables)


def on_own_tokens_BT(fn, *arrays_BT):
  """fn on each device's own tokens (`on_own_tokens`, no tables): arrays sharing leading [B, T] dimensions in, a
  tuple of such arrays out. For per-token work the compiler does not partition by itself: XLA's TopK (the routers'
  top-k) gathers its whole operand onto every device otherwise."""
  B, T = arrays_BT[0].shape[:2]
  flat = [a.reshape((B * T,) + a.shape[2:]) for a in arrays_BT]
  outs = on_own_tokens(lambda *tokens: tuple(fn(*tokens)), flat, (), ())
  return tuple(o.reshape((B, T) + o.shape[1:]) for o in outs)


def on_own_units(group, local, tokens=(), owned=(), tables=(), table_specs=(), n_owned_outputs=0, out_dtype=None):
  """local over each device's own units for the tokens of its expert group, in one shard_map.

  `tokens` are [N, ...] arrays every unit reads (all-gathered over the group: `expert_collectives.gather_tokens`), `owned`
  [N, U, ...] per-unit routing data (sent to the units' owners: `expert_collectives.to_owners`, unit dimension 1), `tables`
  enter as stored, split by `table_specs`. local(tokens_g, owned_g, tables_u) returns (y_g, *per-unit
  outputs [g, u, ...]); y's partial sums come back summed over the group to the tokens' owners in float32
  (`expert_collectives.scatter_back`; cast to `out_dtype` if given, its dy then all-gathered in it), the `n_owned_outputs`
  per-unit outputs by the inverse of `to_owners`. Returns (y_N, *per-unit outputs [N, U, ...]).
  """
  n_tokens, n_owned = len(tokens), len(owned)

  def body(*args):
    tokens_g = [expert_collectives.gather_tokens(a, group) for a in args[:n_tokens]]
    owned_g = [expert_collectives.to_owners(a, group, unit_dim=1) for a in args[n_tokens : n_tokens + n_owned]]
    y_g, *owned_outputs_g = local(tokens_g, owned_g, args[n_tokens + n_owned :])
    return (
      expert_collectives.scatter_back(y_g, group, out_dtype),
      *(expert_collectives.from_owners(a, group, unit_dim=1) for a in owned_outputs_g),
    )

  spec = group.token_spec
  return expert_groups.shard_map(
    body,
    group,
    in_specs=(spec,) * (n_tokens + n_owned) + tuple(table_specs),
    out_specs=(spec,) * (1 + n_owned_outputs),
    every_axis=True,  # local may call kernels, which are single-device ops
  )(*tokens, *owned, *tables)

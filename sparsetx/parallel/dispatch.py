"""The dispatcher: layers describe their sparse computation; this module decides where it runs.

A feed-forward layer hands its arrays, gating, kernel options and its table's logical axes to one entry per
sparse op; the entry reads the mesh and rules in the context
(expert_parallel.activate) and runs the plain single-device computation or its expert-parallel form (listed in docs/modules.md).

More: docs/modules.md, sparsetx/parallel/dispatch.py.
"""

import contextlib
import contextvars
import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from sparsetx.config import TABLE_PLACEMENTS
from sparsetx.kernels import platform
from sparsetx.kernels.gated_gather import gated_gather
from sparsetx.kernels.reference import Gating
from sparsetx.kernels.sliced_gather import sliced_gated_gather
from sparsetx.kernels.tree_route import sparse_forward
from sparsetx.parallel import expert_parallel as ep

# The logical name of a table's d_model dimension under the fsdp placement: the rules' `batch` axes, so the table is
# split over every device that holds other tokens (ZeRO-3's layout) and gathered from all of them.
FSDP_TABLE_AXIS = "batch"
PLACEMENTS = tuple(p for p in TABLE_PLACEMENTS if p != "auto")  # what a layer runs: "auto" is resolved before


def placement_of(ffn) -> str:
  """The placement a layer with feed-forward sub-config `ffn` runs. "auto" is resolved for a mesh by
  plan/step_cost.resolve_placements (the trainer's setup does); unresolved (a model built without a mesh in
  view: evaluation, export) it runs "expert", the layout the rules give."""
  placement = ffn.get("placement", "auto")
  return "expert" if placement == "auto" else placement


def placed_names(names: tuple, placement: str) -> tuple:
  """The logical axis names a table is stored with under `placement`: as the layer gives them (expert), its
  d_model (`embed`) dimension on the batch axes and nothing else split (fsdp), or nothing split (data)."""
  if placement == "data":
    return (None,) * len(names)
  if placement == "fsdp":
    return tuple(FSDP_TABLE_AXIS if name == "embed" else None for name in names)
  return tuple(names)


@dataclasses.dataclass(frozen=True)
class NeuronTable:
  """A layer's neuron table as stored: its logical axes, which of them holds its units, and their count."""

  axes: tuple  # logical axis names of the parameter as the layer gives them, e.g. (None, "channel", "neuron", "embed")
  unit_axis: str | None  # the units' logical name ("channel"); None for a table shared by every channel (PEER)
  n_units: int
  placement: str = "expert"  # one of PLACEMENTS

  @property
  def stored_axes(self) -> tuple:
    """The logical names the parameter is declared with (its placement's)."""
    return placed_names(self.axes, self.placement)

  def layout(self, n_tokens: int):
    """The expert group this table's layout gives n_tokens tokens, or None for the plain computation (also for
    the fsdp and data placements, whose tables are whole where the kernels run)."""
    if self.placement != "expert":
      return None
    return ep.table_group(self.axes, self.unit_axis, self.n_units, n_tokens)


_TABLES = contextvars.ContextVar("sparsetx_tables", default=None)  # {param path: (axes, local)} while recording


def table_param(module, name: str, init, shape, dtype, axes: tuple, local: tuple, placement: str = "expert"):
  """module.param(name, ...) for a table the dispatcher runs on: `shape` as stored, logical `axes` as the layer
  gives them (stored as `placement` places them, `placed_names`); `local` names the dimensions the expert
  placement's dispatcher takes as this device's block (units; a neuron table's d_model). Inside the step's
  per-device microbatch loop (parallel/microbatches.py), whose batch axes are manual, the table enters as that block
  (`ep.block_shape`) and the dispatcher's body runs on it without opening a shard_map over those axes; the fsdp
  and data placements' tables enter whole (gathered once, before the loop). `recording_tables` collects, by
  parameter path, the tables declared this way."""
  axes, local = placed_names(axes, placement), (tuple(local) if placement == "expert" else ())
  recorded = _TABLES.get()
  if recorded is not None:
    recorded[tuple(module.scope.path) + (name,)] = (tuple(axes), tuple(local))
  block = ep.block_shape(shape, axes, local, jax.sharding.get_abstract_mesh(), ep.active_rules())
  return module.param(name, nn.with_logical_partitioning(init, axes), block, dtype)


@contextlib.contextmanager
def recording_tables():
  """Yields a dict that `table_param` fills while in this context: {parameter path (tuple of names): (logical
  axes, dimensions taken as blocks)} of every table the model declares (the train step traces the model's init
  in it to learn which parameters enter its per-device loop as blocks)."""
  token = _TABLES.set({})
  try:
    yield _TABLES.get()
  finally:
    _TABLES.reset(token)


def place_on_token_shards(a_BT, table: NeuronTable):
  """a [B, T, ...] kept on the tokens' layout when the layer runs on a mesh, so its router runs where the tokens
  are (else the compiler may follow the router's sharded keys and gather every score everywhere)."""
  n_tokens = a_BT.shape[0] * a_BT.shape[1]
  group = table.layout(n_tokens) if table.placement == "expert" else _token_group(n_tokens)
  return a_BT if group is None else ep.on_token_shards(a_BT, group)


def _token_group(n_tokens: int):
  """An ExpertGroup of the batch axes alone (no units), or None with no mesh or tokens that don't split."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return None
  group = ep.ExpertGroup(mesh, ep.active_mesh_axes(mesh, "batch"), ())
  if not group.batch or n_tokens % group.n_token_shards:
    return None
  return group


def on_own_tokens(fn, tokens, tables, table_names):
  """fn(*tokens_n, *whole tables) on each device's own tokens: the fsdp and data placements, in one shard_map.

  `tokens` are [N, ...] arrays split like the batch; `tables` are stored as their logical names `table_names`
  give under the rules (`placed_names`): a dimension split over batch axes (fsdp) is all-gathered whole here,
  minor axis first so the blocks land in order, and its gradient comes back by the transpose, a reduce-scatter;
  a replicated table (data) enters as it is, and the shard_map's transpose all-reduces its gradient. fn returns
  a tuple of [n, ...] arrays; they come back as [N, ...]. Every free mesh axis is manual inside
  (`ep.every_axis_manual`: MoE's kernels may be Mosaic's). With no mesh, or tokens that don't split evenly over
  the batch axes (a batch of 1 at init), fn runs on everything and the compiler gathers the tables.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return fn(*tokens, *tables)
  rules, manual = ep.active_rules(), ep.manual_axes(mesh)
  batch = tuple(a for a in ep.active_mesh_axes(mesh, "batch") if a not in manual)
  split = [
    [ep.sized_axes(mesh, entry) for entry in ep.free_spec(ep.table_spec(names, rules), mesh)] for names in table_names
  ]
  specs = [PartitionSpec(*(dims or None for dims in table_dims)) for table_dims in split]
  axes = set(batch) | {a for dims in split for axis_tuple in dims for a in axis_tuple}
  free = set(mesh.axis_names) - set(manual)
  # Nothing to split and no manual region around (inside one, a Mosaic kernel still needs every axis manual).
  if not free or not (axes or manual) or tokens[0].shape[0] % math.prod(mesh.shape[a] for a in batch):
    return fn(*tokens, *tables)

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
  free, in_specs, out_spec = ep.every_axis_manual(mesh, axes, (token_spec,) * len(tokens) + tuple(specs), token_spec)
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec, axis_names=free, check_vma=False)(
    *tokens, *tables
  )


def where_tokens_are(fn, *arrays_BT):
  """fn on each device's own tokens: a shard_map over the batch axes when a mesh is in the context.

  For per-token work the compiler does not partition by itself: XLA's TopK (the routers' top-k)
  gathers its whole operand onto every device otherwise. Arrays share leading [B, T] dimensions;
  fn maps them to arrays with the same leading dimensions.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return fn(*arrays_BT)
  batch = tuple(a for a in ep.active_mesh_axes(mesh, "batch") if a not in ep.manual_axes(mesh))
  B, T = arrays_BT[0].shape[:2]
  if not batch or (B * T) % math.prod(mesh.shape[a] for a in batch):
    return fn(*arrays_BT)
  flat = [a.reshape((B * T,) + a.shape[2:]) for a in arrays_BT]
  spec = PartitionSpec(batch)
  outs = jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=(spec,) * len(flat),
    out_specs=spec,
    axis_names=set(batch),
    check_vma=False,
  )(*flat)
  return jax.tree.map(lambda o: o.reshape((B, T) + o.shape[1:]), outs)


def token_parallel(group, local, tokens=(), owned=(), tables=(), table_specs=(), n_owned_outputs=0, out_dtype=None):
  """local over each device's own units for the tokens of its expert group, in one shard_map.

  `tokens` are [N, ...] arrays every unit reads (all-gathered over the group: `ep.gather_tokens`), `owned`
  [N, U, ...] per-unit routing data (sent to the units' owners: `ep.to_owners`, unit dimension 1), `tables`
  enter as stored, split by `table_specs`. local(tokens_g, owned_g, tables_u) returns (y_g, *per-unit
  outputs [g, u, ...]); y's partial sums come back summed over the group to the tokens' owners in float32
  (`ep.scatter_back`; cast to `out_dtype` if given, its dy then all-gathered in it), the `n_owned_outputs`
  per-unit outputs by the inverse of `to_owners`. Returns (y_N, *per-unit outputs [N, U, ...]).
  """
  n_tokens, n_owned = len(tokens), len(owned)

  def body(*args):
    tokens_g = [ep.gather_tokens(a, group) for a in args[:n_tokens]]
    owned_g = [ep.to_owners(a, group, unit_dim=1) for a in args[n_tokens : n_tokens + n_owned]]
    y_g, *owned_outputs_g = local(tokens_g, owned_g, args[n_tokens + n_owned :])
    return (ep.scatter_back(y_g, group, out_dtype), *(ep.from_owners(a, group, unit_dim=1) for a in owned_outputs_g))

  spec = group.token_spec
  return ep.shard_map(
    body,
    group,
    in_specs=(spec,) * (n_tokens + n_owned) + tuple(table_specs),
    out_specs=(spec,) * (1 + n_owned_outputs),
  )(*tokens, *owned, *tables)


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
  if table.placement != "expert":
    return _whole_table_gather(
      table, x_BTD, experts_2UFD, idx_BTUK, gates_BTUK, activation, options, gate_inside_activation
    )
  U, K = idx_BTUK.shape[2:]  # the units of the routing: the table may be this device's block (`table_param`)
  F = experts_2UFD.shape[2]
  group = table.layout(B * T)
  if group is not None and group.split:
    x_ND, idx_NUK, gates_NUK = x_BTD.reshape(B * T, D), idx_BTUK.reshape(B * T, U, K), gates_BTUK.reshape(B * T, U, K)
    y_ND = split_gated_gather(
      group, x_ND, experts_2UFD, idx_NUK, gates_NUK, activation, options, gate_inside_activation=gate_inside_activation
    )
    return y_ND.reshape(B, T, D)
  if group is not None:
    return _unit_split_gather(group, x_BTD, experts_2UFD, idx_BTUK, gates_BTUK, activation, options)
  rows_BTS = (idx_BTUK + F * jnp.arange(U, dtype=idx_BTUK.dtype)[None, None, :, None]).reshape(B, T, U * K)
  return gated_gather(
    x_BTD,
    experts_2UFD[0].reshape(U * F, D),
    experts_2UFD[1].reshape(U * F, D),
    rows_BTS,
    gates_BTUK.reshape(B, T, U * K),
    activation,
    options=options,
    gate_inside_activation=gate_inside_activation,
  )


def _whole_table_gather(table, x_BTD, experts_2UFD, idx_BTUK, gates_BTUK, activation, options, gate_inside_activation):
  """The fsdp and data placements: the single-device gated gather on each device's own tokens, the table whole."""
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


def _own_units_gather(x_nD, idx_nuK, gates_nuK, experts_2uFD, activation, options, gate_inside_activation=True):
  """The single-device gated gather over the u units a device holds (experts [2, u, F, D]): unit j's neurons are
  rows j F .. (j + 1) F - 1 of the units' tables stacked."""
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
  )


def _unit_split_gather(group, x_BTD, experts_2UFD, idx_BTUK, gates_BTUK, activation, options):
  """The gated gather with its units (sgatlin's channels) split over the group: each device its own units."""
  B, T, D = x_BTD.shape
  U, K = idx_BTUK.shape[2:]

  def local(tokens_g, owned_g, tables_u):
    (x_gD,), (idx_guK, gates_guK), (experts_2uFD,) = tokens_g, owned_g, tables_u
    return (_own_units_gather(x_gD, idx_guK, gates_guK, experts_2uFD, activation, options),)

  (y_ND,) = token_parallel(
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

  Each device holds experts[:, u-block, :, d-slice] (`ep.table_group`) and never sends it. Inside
  `token_parallel`, x goes to the devices of its d-group by d-slice and the indices and gates are
  all-gathered over it; kernels/sliced_gather.py sums the partial dots over the d-group before the
  activation and the gate; y's d-slices come back by the inverse of x's move. Returns y [N, D] in x's dtype.
  """
  N, D = x_ND.shape
  U, K = idx_NUK.shape[1:]
  F = experts_2UFD.shape[2]
  dtype = x_ND.dtype
  gating = Gating(activation, bool(gate_inside_activation))

  def local(tokens_g, owned_g, tables_u):
    (x_gD,), (idx_guK, gates_guK), (experts_2uFd,) = tokens_g, owned_g, tables_u
    u, d = experts_2uFd.shape[1], experts_2uFd.shape[-1]
    x_hd = ep.to_owners(x_gD, group, unit_dim=1, axes=group.split)  # d-slices: their owners are the split axes
    idx_huK, gates_huK = _gather_over_slices(idx_guK, group), _gather_over_slices(gates_guK, group)
    rows_hS = (idx_huK + F * jnp.arange(u, dtype=idx_huK.dtype)[None, :, None]).reshape(-1, u * K)
    y_hd = sliced_gated_gather(
      gating,
      options,
      group.split,
      x_hd,
      experts_2uFd[0].reshape(u * F, d),
      experts_2uFd[1].reshape(u * F, d),
      rows_hS,
      gates_huK.reshape(rows_hS.shape),
    )
    # Summed over the units in float32 (`ep.scatter_back`); with no unit axes the sum is nothing and y moves in x's dtype.
    return (ep.from_owners(y_hd.astype(jnp.float32 if group.units else dtype), group, unit_dim=1, axes=group.split),)

  (y_ND,) = token_parallel(
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
  return ep.all_gather(a_g, tuple(a for a in group.split if a in group.batch))


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
  placement: str = "expert",
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
  if placement != "expert":
    names = tuple(placed_names(n, placement) for n in (table_axes, bias_axes, table_axes))
    y_ND, path_NPL, z_NPL = on_own_tokens(
      lambda x_nD, *tables: sparse_forward(x_nD, *tables, depth, activation, options),
      (x_ND,),
      (w_in_PZD, b_in_PZ, w_out_PZD),
      names,
    )
    return y_ND.reshape(B, T, D), path_NPL.reshape(B, T, P, L), z_NPL.reshape(B, T, P, L)
  P = ep.whole_units(P, table_axes[0])  # the expert placement's tables may be blocks (`table_param`)
  group = ep.expert_group(table_axes[0], P, B * T)
  if group is None:
    y_ND, path_NPL, z_NPL = sparse_forward(x_ND, w_in_PZD, b_in_PZ, w_out_PZD, depth, activation, options)
  else:

    def local(tokens_g, _, tables_p):
      return sparse_forward(tokens_g[0], *tables_p, depth, activation, options)

    trees = PartitionSpec(group.unit_spec)
    y_ND, path_NPL, z_NPL = token_parallel(
      group,
      local,
      tokens=(x_ND,),
      tables=(w_in_PZD, b_in_PZ, w_out_PZD),
      table_specs=(trees,) * 3,
      n_owned_outputs=2,
    )
  return y_ND.reshape(B, T, D), path_NPL.reshape(B, T, P, L), z_NPL.reshape(B, T, P, L)


def expert_dispatch(
  experts_fn,
  sorted_fn,
  x_BTD,
  ids_BTA,
  weights_BTA,
  tables,
  *,
  table_axes,
  placement="expert",
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
  if placement == "expert":
    group = ep.expert_group(table_axes[0], ep.whole_units(tables[0].shape[0], table_axes[0]), B * T)
  if group is None:  # every expert on every device: each sorts and computes its own tokens' pairs
    names = tuple(placed_names(n, placement) for n in (table_names or (table_axes,) * len(tables)))
    (y_ND,) = on_own_tokens(lambda *args: (experts_fn(*args),), flat, tuple(tables), names)
    return y_ND.reshape(B, T, D)
  experts = PartitionSpec(group.unit_spec)
  if all(a in group.batch for a in group.units):
    y_ND = ep.shard_map(
      functools.partial(all_to_all_experts, sorted_fn, group),
      group,
      in_specs=(group.token_spec,) * 3 + (experts,) * len(tables),
      out_specs=group.token_spec,
      every_axis=True,
    )(*flat, *tables)
    return y_ND.reshape(B, T, D)

  def local(tokens_g, _, tables_e):
    first = tables_e[0].shape[0] * ep.unit_index(group)
    return (experts_fn(*tokens_g, *tables_e, first_expert=first),)

  (y_ND,) = token_parallel(
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
  me = ep.unit_index(group)
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

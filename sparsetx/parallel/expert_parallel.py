"""Expert parallelism: which devices share a sparse layer's units, and how tokens move between them.

A sparse layer's units (sgatlin channels, FFF trees, MoE experts) are split over the mesh axes
that `config.mesh.rules` gives their logical name (`channel`, `tree`, `expert` -> `expert`).
Moving tables is what makes a sharded sparse layer slow, so the layers move activations instead,
inside one explicit `jax.shard_map` each:

  1. `gather_tokens`: every device of an expert group receives the tokens of the whole group
     (all-gather over the unit axes that also split the batch);
  2. `to_owners` / `from_owners`: per-unit routing data (indices, gates) goes only to the
     device owning the unit (all-to-all: split units, concatenate tokens), and back;
  3. each device runs the unsharded computation for its units and the group's tokens;
  4. `scatter_back`: the partial outputs are summed over the group and each device keeps its
     own tokens (reduce-scatter), the transpose of step 1.

A unit axis that does not split the batch holds the same tokens on every device: step 1 is
nothing, step 2 a local slice and step 4 an all-reduce. Mesh axes of size 1 are skipped.

A neuron table (sgatlin, PEER) whose d_model is split too (`table_group`: the rules give its `embed`
axis mesh axes; PEER's shared table has no other way to split, sgatlin needs it when the expert
axis is larger than C) runs `split_gated_gather`: between steps 2 and 3, x goes to the S devices
of a d-group by d-slice (all-to-all) and the indices and gates are all-gathered over it; step 3
computes partial dots on the slice, sums them over the d-group (an all-reduce of [tokens, picks]
float32 scalars, before the activation and gate), and the output's d-slices come back by the
inverse all-to-all before step 4. The table never moves.

The layers find the mesh and the rules in the context: `activate(mesh, rules)` sets the mesh
(`jax.set_mesh`) and the logical rules (a context variable here; flax's own `nn.logical_axis_rules`
would also turn on flax's parameter sharding constraints, which the DenseGeneral routers reject). With no
mesh, or a unit axis of size 1, the layers run their plain single-device computation, so nothing changes for
one device.
"""

import contextlib
import contextvars
import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sparsetx.config import DEFAULT_RULES, ConfigError
from sparsetx.kernels import segment_grads
from sparsetx.kernels.reference import Gating

# Put first in config.mesh.rules, these split every `embed` axis over fsdp x expert and keep channels whole:
# neuron tables (PEER's shared one; sgatlin's when the expert axis is larger than its channel count)
# are then split by d_model over the expert axis, and the layers run `split_gated_gather`.
D_MODEL_SPLIT_RULES = (("embed", ("fsdp", "expert")), ("channel", None))

_RULES = contextvars.ContextVar("sparsetx_logical_rules", default=DEFAULT_RULES)


@contextlib.contextmanager
def activate(mesh, rules=DEFAULT_RULES):
  """Mesh and logical rules in the context, so sparse layers trace their expert-parallel form."""
  token = _RULES.set(tuple(tuple(rule) for rule in rules))
  try:
    with jax.set_mesh(mesh):
      yield
  finally:
    _RULES.reset(token)


def _mesh_axes(rules, logical_name: str) -> tuple:
  """The mesh axes of a logical name under flax's rules (the first rule naming it)."""
  for name, axes in rules:
    if name == logical_name:
      if axes is None:
        return ()
      return (axes,) if isinstance(axes, str) else tuple(axes)
  return ()


@dataclasses.dataclass(frozen=True)
class ExpertGroup:
  """The mesh axes of the tokens (`batch`) and of a layer's units (`units`), sizes > 1 only."""

  mesh: object  # jax.sharding.AbstractMesh
  batch: tuple
  units: tuple
  split: tuple = ()  # mesh axes splitting a neuron table's d_model (`split_gated_gather`)

  @property
  def n_unit_shards(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.units)

  @property
  def n_token_shards(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.batch)

  @property
  def token_spec(self) -> P:
    """Spec of a [tokens, ...] array split like the batch."""
    return P(self.batch or None)

  @property
  def unit_spec(self):
    """Mesh axes of a units dimension, for a table's PartitionSpec."""
    return self.units or None

  @property
  def split_spec(self):
    """Mesh axes of a table's d_model dimension, for its PartitionSpec."""
    return self.split or None


def expert_group(logical_name: str, n_units: int, n_tokens: int, field: str):
  """The ExpertGroup for units named `logical_name`, or None to run the plain computation.

  None when there is no mesh in the context, when the units' mesh axes have size 1, or when the
  tokens don't split evenly over the batch axes (e.g. a batch of 1 at init). Units that don't
  split evenly are a config mistake and are refused, naming `field`.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return None
  rules = _RULES.get()
  group = ExpertGroup(mesh, _sized(mesh, _mesh_axes(rules, "batch")), _sized(mesh, _mesh_axes(rules, logical_name)))
  return _checked(group, n_units, n_tokens, field) if group.units else None


def _sized(mesh, axes) -> tuple:
  """The mesh axes (a name, a tuple of names or None) of size > 1."""
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)


def active_mesh_axes(mesh, logical_name: str) -> tuple:
  """The mesh axes of size > 1 that the active rules map `logical_name` to (e.g. 'batch', 'heads')."""
  return _sized(mesh, _mesh_axes(_RULES.get(), logical_name))


def _checked(group: ExpertGroup, n_units: int, n_tokens: int, field: str):
  """The group, refusing units that don't split evenly (naming `field`); None if the tokens don't split."""
  if n_units % group.n_unit_shards:
    shape = " x ".join(f"{a}={group.mesh.shape[a]}" for a in group.units)
    raise ConfigError(
      f"{field}={n_units} is not divisible by the {group.n_unit_shards} devices of the mesh axes it is split over "
      f"({shape}); make {field} a multiple of {group.n_unit_shards} or shrink those mesh axes."
    )
  if n_tokens % group.n_token_shards:
    return None
  return group


def table_group(table_names, unit_name, n_units: int, n_tokens: int, field: str):
  """The ExpertGroup of a neuron table (sgatlin, PEER) as the rules lay it out, or None for the plain computation.

  The table's PartitionSpec comes from its logical names under the rules (flax's assignment, so it
  is the layout the parameter is stored in): `units` are the mesh axes of its `unit_name` dimension
  (None for PEER's shared table), `split` those of its last (d_model) dimension. With the default
  rules sgatlin's channels go to `expert` and d_model to `fsdp`, so a mesh expert=C x fsdp=S holds
  rows[:, c, :, d-slice] on each device; rules mapping `embed` to ("fsdp", "expert") put a table's
  d_model on the expert axis (PEER's form; with ("channel", None) before them, sgatlin's when the
  expert axis is larger than C).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return None
  rules = _RULES.get()
  spec = _table_spec(table_names, rules)
  units = _sized(mesh, spec[table_names.index(unit_name)]) if unit_name else ()
  group = ExpertGroup(mesh, _sized(mesh, _mesh_axes(rules, "batch")), units, _sized(mesh, spec[-1]))
  if not group.units and not group.split:
    return None
  return _checked(group, n_units, n_tokens, field)


def _table_spec(table_names, rules) -> tuple:
  """The mesh axes of each dimension of a table with these logical names (flax's assignment)."""
  spec = tuple(nn.logical_to_mesh_axes(table_names, tuple(tuple(rule) for rule in rules)))
  return spec + (None,) * (len(table_names) - len(spec))


def split_gated_gather(
  group: ExpertGroup, x_ND, experts_2UND, idx_NUK, gates_NUK, activation, options, gate_inside_activation=True
):
  """A neuron table's gated gather with its units and its d_model split over the group, in one shard_map.

  y[t] = sum_u sum_k a(<w_in[u, i], x[t]>, gates[t, u, k]) * w_out[u, i], i = idx[t, u, k], with the slot
  coefficient a = act(g * h) (`gate_inside_activation`, sgatlin) or g * act(h) (PEER), as the gated gather.
  Each device holds experts[:, u-block, :, d-slice] (`table_group`) and never sends it. Steps:
  tokens gathered and indices sent to the units' owners as in the channel form (`gather_tokens`,
  `to_owners`); then over the split axes x goes out by d-slice (all-to-all: each device keeps its
  slice of the d-group's tokens) and indices and gates are all-gathered; each device dots its
  slice of the picked w_in rows (partial dots), the partial dots are summed over the d-group
  (all-reduce of [tokens, units * k] float32 scalars: this sum is why the split is exact, the
  activation and gate act on whole dots), and gated slices of the picked w_out rows give the
  output's d-slice, which goes back by all-to-all (the inverse of the x all-to-all) and then
  through `scatter_back` over the unit axes. The partial dots and sums use float32. `options`
  (a KernelOptions) gives the token chunk of the gathers and the pair chunk of the table gradients.
  """
  N, D = x_ND.shape
  U, K = idx_NUK.shape[1:]
  n_neurons = experts_2UND.shape[2]
  dtype = x_ND.dtype
  gating = Gating(activation, bool(gate_inside_activation))

  def local(x_nD, experts_2uNd, idx_nUK, gates_nUK):
    u, d = experts_2uNd.shape[1], experts_2uNd.shape[-1]
    x_gD = gather_tokens(x_nD, group)
    idx_guK, gates_guK = to_owners(idx_nUK, group, unit_dim=1), to_owners(gates_nUK, group, unit_dim=1)
    x_hd = to_owners(x_gD, group, unit_dim=1, axes=group.split)  # d-slices: their owners are the split axes
    idx_huK, gates_huK = _gather_over_slices(idx_guK, group), _gather_over_slices(gates_guK, group)
    rows_hS = (idx_huK + n_neurons * jnp.arange(u, dtype=idx_huK.dtype)[None, :, None]).reshape(-1, u * K)
    y_hd = _sliced_gated_gather(
      gating,
      options,
      group.split,
      x_hd,
      experts_2uNd[0].reshape(u * n_neurons, d),
      experts_2uNd[1].reshape(u * n_neurons, d),
      rows_hS,
      gates_huK.reshape(rows_hS.shape),
    )
    y_gD = from_owners(y_hd.astype(jnp.float32 if group.units else dtype), group, unit_dim=1, axes=group.split)
    return scatter_back(y_gD, group) if group.units else y_gD

  tokens = group.token_spec
  y_ND = shard_map(
    local,
    group,
    in_specs=(tokens, P(None, group.unit_spec, None, group.split_spec), tokens, tokens),
    out_specs=tokens,
  )(x_ND, experts_2UND, idx_NUK.reshape(N, U, K), gates_NUK.reshape(N, U, K))
  return y_ND.astype(dtype)


def _gather_over_slices(a_g, group: ExpertGroup):
  """Per-token routing data of the whole d-group: all-gather over the split axes that split the batch."""
  return _all_gather(a_g, tuple(a for a in group.split if a in group.batch))


def _rows_dot(options, a_hd, table_Rd, rows_hS):
  """[h, S]: <a[t], table[rows[t, s]]> in float32, `token_chunk` tokens' rows gathered at a time."""
  dot = lambda a_d, rows_S: jnp.einsum(
    "d,sd->s",
    a_d,
    table_Rd[rows_S].astype(a_d.dtype),  # noqa: E731
    preferred_element_type=jnp.float32,
  )
  return jax.lax.map(lambda pair: dot(*pair), (a_hd, rows_hS), batch_size=options.token_chunk)


def _rows_sum(options, coef_hS, table_Rd, rows_hS, dtype):
  """[h, d]: sum_s coef[t, s] * table[rows[t, s]] in float32, chunked like `_rows_dot`."""
  weighted = lambda c_S, rows_S: jnp.einsum(
    "s,sd->d",
    c_S.astype(dtype),
    table_Rd[rows_S].astype(dtype),  # noqa: E731
    preferred_element_type=jnp.float32,
  )
  return jax.lax.map(lambda pair: weighted(*pair), (coef_hS, rows_hS), batch_size=options.token_chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _sliced_gated_gather(gating, options, axes, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS):
  """One device's d-slice of the gated gather; partial dots summed over `axes`. Returns y [h, d] float32."""
  return _sliced_forward(gating, options, axes, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS)[0]


def _sliced_forward(gating, options, axes, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS):
  partial_hS = _rows_dot(options, x_hd, w_in_Rd, rows_hS)
  h_hS = jax.lax.psum(partial_hS, axes) if axes else partial_hS
  a_hS = gating.value(h_hS, gates_hS.astype(jnp.float32))
  y_hd = _rows_sum(options, a_hS, w_out_Rd, rows_hS, x_hd.dtype)
  return y_hd, (x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS, h_hS)


def _sliced_backward(gating, options, axes, residuals, dy_hd):
  """Gradients as the gated gather's (sorted-segment table sums), with the d-group's sums made explicit.

  <dy, w_out[row]> is partial on a d-slice: summed over the d-group it drives dL/dh (the same on
  every device of the group, as h is); left partial it gives this slice's share of the gate
  gradient (da/dgate * partial dyw: linear in dyw), which the transpose of the gates' all-gather sums
  over the group.
  """
  x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS, h_hS = residuals
  dy_hd = dy_hd.astype(x_hd.dtype)
  dyw_partial_hS = _rows_dot(options, dy_hd, w_out_Rd, rows_hS)
  dyw_hS = jax.lax.psum(dyw_partial_hS, axes) if axes else dyw_partial_hS
  a_hS, da_dh_hS, da_dg_hS = gating.value_and_slopes(h_hS, gates_hS.astype(jnp.float32))
  coef_in_hS = da_dh_hS * dyw_hS
  dx_hd = _rows_sum(options, coef_in_hS, w_in_Rd, rows_hS, x_hd.dtype)
  dw_in, dw_out, _ = segment_grads.table_grads(
    x_hd, dy_hd, rows_hS, coef_in_hS, a_hS, w_in_Rd.shape[0], options.pair_chunk, False
  )
  return (
    dx_hd.astype(x_hd.dtype),
    dw_in.astype(w_in_Rd.dtype),
    dw_out.astype(w_out_Rd.dtype),
    np.zeros(rows_hS.shape, jax.dtypes.float0),
    (da_dg_hS * dyw_partial_hS).astype(gates_hS.dtype),
  )


_sliced_gated_gather.defvjp(_sliced_forward, _sliced_backward)


def on_token_shards(a_BT, group: ExpertGroup):
  """Constrains a [B, T, ...] array to the batch layout, so the router runs where the tokens are.

  Without it the compiler may follow the router's channel-sharded keys and gather the scores of
  the whole batch onto every device.
  """
  B, T = a_BT.shape[:2]
  a_N = a_BT.reshape((B * T,) + a_BT.shape[2:])
  a_N = jax.lax.with_sharding_constraint(a_N, jax.sharding.NamedSharding(group.mesh, group.token_spec))
  return a_N.reshape(a_BT.shape)


def where_tokens_are(fn, *arrays_BT):
  """fn on each device's own tokens: a shard_map over the batch axes when a mesh is in the context.

  For per-token work the compiler does not partition by itself: XLA's TopK (the routers' top-k)
  gathers its whole operand onto every device otherwise. Arrays share leading [B, T] dimensions;
  fn maps them to arrays with the same leading dimensions.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return fn(*arrays_BT)
  batch = active_mesh_axes(mesh, "batch")
  B, T = arrays_BT[0].shape[:2]
  if not batch or (B * T) % math.prod(mesh.shape[a] for a in batch):
    return fn(*arrays_BT)
  flat = [a.reshape((B * T,) + a.shape[2:]) for a in arrays_BT]
  spec = P(batch)
  outs = jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=(spec,) * len(flat),
    out_specs=spec,
    axis_names=set(batch),
    check_vma=False,
  )(*flat)
  return jax.tree.map(lambda o: o.reshape((B, T) + o.shape[1:]), outs)


def gather_tokens(x_n, group: ExpertGroup):
  """[local tokens, ...] -> [group tokens, ...]: all-gather over the unit axes that split the batch.

  Its transpose (the gradient) reduce-scatters in float32, like `scatter_back`.
  """
  axes = tuple(a for a in group.units if a in group.batch)
  if not axes or not jnp.issubdtype(x_n.dtype, jnp.floating):
    return _all_gather(x_n, axes)
  return _gather_f32_grad(x_n, axes)


def _all_gather(x_n, axes):
  for axis in axes:
    x_n = jax.lax.all_gather(x_n, axis, axis=0, tiled=True)
  return x_n


def _reduce_scatter(y_g, axes):
  for axis in reversed(axes):
    y_g = jax.lax.psum_scatter(y_g, axis, scatter_dimension=0, tiled=True)
  return y_g


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_f32_grad(x_n, axes):
  return _all_gather(x_n, axes)


def _gather_fwd(x_n, axes):
  return _all_gather(x_n, axes), jnp.zeros((), x_n.dtype)


def _gather_bwd(axes, dtype_probe, dy_g):
  return (_reduce_scatter(dy_g.astype(jnp.float32), axes).astype(dtype_probe.dtype),)


_gather_f32_grad.defvjp(_gather_fwd, _gather_bwd)


def to_owners(a_nU, group: ExpertGroup, unit_dim: int, axes: tuple | None = None):
  """[local tokens, all units, ...] -> [group tokens, local units, ...] (all-to-all or local slice).

  Over `axes` (default: the group's unit axes); `split_gated_gather` passes the split axes to send
  x's d-slices ([tokens, D] -> [d-group tokens, D / S]) the same way.
  """
  for axis in group.units if axes is None else axes:
    if axis in group.batch:
      a_nU = jax.lax.all_to_all(a_nU, axis, split_axis=unit_dim, concat_axis=0, tiled=True)
    else:
      size = a_nU.shape[unit_dim] // group.mesh.shape[axis]
      a_nU = jax.lax.dynamic_slice_in_dim(a_nU, jax.lax.axis_index(axis) * size, size, axis=unit_dim)
  return a_nU


def from_owners(a_gU, group: ExpertGroup, unit_dim: int, axes: tuple | None = None):
  """The inverse of `to_owners` (same `axes`): [group tokens, local units, ...] -> [local tokens, all units, ...]."""
  for axis in reversed(group.units if axes is None else axes):
    if axis in group.batch:
      a_gU = jax.lax.all_to_all(a_gU, axis, split_axis=0, concat_axis=unit_dim, tiled=True)
    else:
      a_gU = jax.lax.all_gather(a_gU, axis, axis=unit_dim, tiled=True)
  return a_gU


def scatter_back(y_g, group: ExpertGroup):
  """Sums partial outputs over the group and returns each device its own tokens (reduce-scatter).

  The sum is float32, as the single-device kernels accumulate (and XLA:CPU aborts compiling a
  bf16 reduce-scatter of the gated gather's output); the caller casts the result.
  """
  y_g = y_g.astype(jnp.float32)
  for axis in reversed(group.units):
    if axis in group.batch:
      y_g = jax.lax.psum_scatter(y_g, axis, scatter_dimension=0, tiled=True)
    else:
      y_g = jax.lax.psum(y_g, axis)
  return y_g


def unit_index(group: ExpertGroup):
  """This device's position along the group's unit axes (major to minor), inside the shard_map."""
  index = 0
  for axis in group.units:
    index = index * group.mesh.shape[axis] + jax.lax.axis_index(axis)
  return index


def shard_map(fn, group: ExpertGroup, in_specs, out_specs):
  """jax.shard_map over the group's token and unit axes; the other mesh axes stay with the compiler.

  check_vma is off: the kernels' scans start float32 accumulators from zeros, which the varying-
  axes check rejects inside a shard_map. The tests compare values and gradients with the
  single-device layer on meshes whose batch is split over the expert axis too, and on meshes whose
  d_model split axis (tensor) does not split the batch.
  """
  return jax.shard_map(
    fn,
    mesh=group.mesh,
    in_specs=in_specs,
    out_specs=out_specs,
    axis_names=set(group.batch + group.units + group.split),
    check_vma=False,
  )

"""One gradient reduction per step (issue 25 item 5): with microbatches, the compiled train step sums every parameter's
gradient over the devices after the microbatch loop, not inside it (parallel/microbatches.py `accumulate`: the
loop manual over every batch axis, the tables as each device's blocks, every other parameter gathered once before
it), and its loss and gradients equal the single-microbatch step's."""

import math
import re

import jax
import numpy as np
import pytest
from conftest import load_config, synthetic_batch

from sparsetx import config as config_lib
from sparsetx.measure import aot
from sparsetx.parallel import logical_rules
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib

EPS32 = float(np.finfo(np.float32).eps)
REDUCTIONS = re.compile(r"= (\(.*?\)|\S+) (all-reduce|reduce-scatter)(?:-start)?\(")


MESHES = {  # each device 1/8 of the tokens
  "data2_expert4": dict(data=2, fsdp=1, tensor=1, expert=4),  # one channel's tables per device
  "data2_fsdp2_expert2": dict(data=2, fsdp=2, tensor=1, expert=2),  # two channels' tables, half of d_model (d-split)
}


def mesh_config(microbatches: int, ffn_type: str = "sgatlin", mesh: str = "data2_expert4", placement="expert"):
  """Tiny one-layer model on one of MESHES, its tables placed as given (config.model.ffn.placement)."""
  config = load_config("configs/tiny.py", ffn_type)
  config.model.ffn.placement = placement
  config.model.update(n_layers=1, max_len=32, dtype="float32")  # float32: only the order of the sums differs
  config.data.update(seq_len=32, global_batch_size=16)
  config.train.microbatches = microbatches
  config.mesh.ici.update(MESHES[mesh])
  return config_lib.validate(config)


def computations(hlo_text: str) -> dict:
  """{computation name: its instruction lines} of an HLO module's text."""
  found, current = {}, None
  for line in hlo_text.splitlines():
    header = re.match(r"^(?:ENTRY )?(%[\w.\-]+) .*\{\s*$", line)
    if header:
      current = found.setdefault(header[1], [])
    elif current is not None:
      current.append(line)
  return found


def reached(comps: dict, root: str) -> set:
  """`root` and every computation it calls (fusions, nested loops, reductions' bodies), transitively."""
  seen, todo = set(), [root]
  while todo:
    name = todo.pop()
    if name not in seen:
      seen.add(name)
      for line in comps.get(name, ()):
        for called in re.findall(r"(?:calls|body|condition|to_apply|branch_computations)=\{?([%\w.\-, ]+)\}?", line):
          todo += [c.strip() for c in called.split(",") if c.strip().startswith("%")]
  return seen


def shapes(result_type: str) -> list:
  """The array shapes of an instruction's result type: 'f32[2,64]{1,0}' or a tuple of them -> [(2, 64), ...]."""
  return [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", result_type)]


def iota(text: str) -> np.ndarray:
  """An HLO iota device list '[2,4]T(1,0)' / '[8]' (dims, then an optional transpose of them)."""
  match = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
  dims = [int(d) for d in match[1].split(",")]
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose([int(p) for p in match[2].split(",")]) if match[2] else ids


def replica_groups(line: str) -> list:
  """The device groups (logical ids) a collective's line reduces over, in each of HLO's three spellings."""
  explicit = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
  if explicit:
    return [[int(i) for i in group.split(",") if i] for group in re.findall(r"\{([\d,]*)\}", explicit[1])]
  listed = re.search(r"replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", line)
  if listed:
    return iota(listed[3]).reshape(int(listed[1]), int(listed[2])).tolist()
  meshed = re.search(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?)\))? \{([^}]*)\}", line
  )
  assert meshed, line
  names = re.findall(r"'(\w+)'=(\d+)", meshed[1])
  sizes = [int(size) for _, size in names]
  ids = (iota(meshed[2]) if meshed[2] else np.arange(math.prod(sizes))).reshape(sizes)
  over = [i for i, (name, _) in enumerate(names) if f"'{name}'" in meshed[3]]
  rest = [i for i in range(len(names)) if i not in over]
  return ids.transpose(rest + over).reshape(-1, math.prod(ids.shape[i] for i in over)).tolist()


def gradient_reductions(hlo_text: str, param_shapes: set, trips: int):
  """(inside, outside): (replica groups, result shapes, line) of every all-reduce / reduce-scatter of a parameter-shaped value
  run by the loop of `trips` trips (its body and all it calls), and of those elsewhere in the program."""
  loops = [line for line in hlo_text.splitlines() if f'"known_trip_count":{{"n":"{trips}"}}' in line]
  assert len(loops) == 1, f"expected one loop of {trips} trips, found {len(loops)}"
  comps = computations(hlo_text)
  in_loop = reached(comps, re.search(r"body=(%[\w.\-]+)", loops[0])[1])
  inside, outside = [], []
  for name, lines in comps.items():
    for line in lines:
      match = REDUCTIONS.search(line)
      if match and param_shapes & set(shapes(match[1])):
        found = (replica_groups(line), shapes(match[1]), line.strip()[:160])
        (inside if name in in_loop else outside).append(found)
  return inside, outside


@pytest.mark.parametrize("mesh_name, placement", [(m, "expert") for m in MESHES] + [("data2_expert4", "fsdp")])
def test_microbatch_loop_reduces_no_parameter_gradient(mesh_name, placement):
  """Inside the 2-trip microbatch loop no all-reduce or reduce-scatter has a parameter-shaped result (the whole
  parameter or its stored per-device block): every gradient, dense, FSDP-split and table, is reduced once, after
  the loop, where such reductions are found, the table's block over `data` only (its expert group computed it
  whole). The loop's own collectives are the layers' token movements (activations) and the taps' gathers.
  Before this, the compiler all-reduced every dense gradient over `expert` (and reduce-scattered the FSDP ones
  over `fsdp`) inside each microbatch. The fsdp placement's table, split over every batch axis, is gathered once
  before the loop and its gradient reduce-scattered once after it, over all 8 devices."""
  config = mesh_config(microbatches=2, mesh=mesh_name, placement=placement)
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:8])
  compiled, abstract = aot.compile_train_step(config, mesh)
  param_shapes = set()
  for leaf in jax.tree.leaves(abstract.params):
    param_shapes |= {tuple(leaf.shape), tuple(leaf.sharding.shard_shape(leaf.shape))}
  param_shapes.discard(())
  inside, outside = gradient_reductions(compiled.as_text(), param_shapes, trips=2)
  assert not inside, inside
  reduced = {shape for _, result, _ in outside for shape in result}
  # After the loop: the table's gradient block and the dense ones (the head's).
  table = abstract.params["layers_0"]["mlp"]["experts"]
  block = tuple(table.sharding.shard_shape(table.shape))
  for leaf in (table, abstract.params["lm_head"]["kernel"]):
    assert tuple(leaf.sharding.shard_shape(leaf.shape)) in reduced, sorted(reduced)
  if placement == "fsdp":
    table_groups = [groups for groups, result, _ in outside if block in result]
    assert table_groups and all(len(group) == mesh.size for groups in table_groups for group in groups), table_groups
    return
  # The table's block is summed over `data` only: its devices' expert (and fsdp) coordinates agree in every group
  # (logical device i of the program is mesh.devices.flat[i]).
  coords = np.stack(np.unravel_index(np.arange(mesh.size), mesh.devices.shape), axis=1)
  others = [i for i, name in enumerate(mesh.axis_names) if name != "data"]
  table_groups = [groups for groups, result, _ in outside if block in result]
  assert table_groups and all(
    len({tuple(coords[d, others]) for d in group}) == 1 for groups in table_groups for group in groups
  ), table_groups


@pytest.mark.parametrize(
  "ffn_type, mesh_name, placement",
  [
    ("sgatlin", "data2_expert4", "expert"),
    ("sgatlin", "data2_fsdp2_expert2", "expert"),
    ("peer", "data2_fsdp2_expert2", "expert"),  # the shared table's d-split over fsdp
    ("fff", "data2_fsdp2_expert2", "expert"),  # trees as blocks, their d_model gathered like a dense weight's
    ("sgatlin", "data2_expert4", "fsdp"),  # the table whole in the loop, gathered once before it
    ("fff", "data2_fsdp2_expert2", "data"),  # replicated trees, their gradient all-reduced once
  ],
)
def test_per_device_accumulation_equals_one_microbatch(ffn_type, mesh_name, placement):
  """loss_and_grads as the train step runs it (param_specs given): microbatches=2 (the per-device loop) equals
  microbatches=1 (one auto-sharded pass) on the same mesh, parameters and batch. The same tokens' terms are
  summed in another order (per device, then over devices once), so the loss is within 16 eps32 and each gradient
  leaf within 64 eps32 of its largest element; the token count is exact."""
  config = mesh_config(microbatches=2, ffn_type=ffn_type, mesh=mesh_name, placement=placement)
  built = state_lib.setup(config, jax.devices()[:8])
  params = state_lib.create_state(config, built.shardings, built.model, built.tx).params
  batch = jax.device_put(synthetic_batch(config), built.batch_sharding)
  specs = jax.tree.map(lambda sharding: sharding.spec, built.shardings.params)
  assert logical_rules.per_device_axes(built.mesh, config.mesh.rules) == tuple(
    a for a in ("data", "fsdp", "expert") if built.mesh.shape[a] > 1
  )
  results = []
  for microbatches in (2, 1):
    train = mesh_config(microbatches, ffn_type, mesh_name, placement).train
    run = jax.jit(
      lambda p, b: step_lib.loss_and_grads(p, b, model=built.model, train=train, param_specs=specs)[:3],  # noqa: B023
      in_shardings=(built.shardings.params, built.batch_sharding),
    )
    with logical_rules.activate(built.mesh, config.mesh.rules):
      results.append(jax.device_get(run(params, batch)))
  (loss, grads, tokens), (want_loss, want_grads, want_tokens) = results
  assert tokens == want_tokens == config.data.global_batch_size * config.data.seq_len - config.data.seq_len // 2
  np.testing.assert_allclose(loss, want_loss, rtol=16 * EPS32)
  for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, want, atol=64 * EPS32 * float(np.abs(want).max()), rtol=0, err_msg=str(path))


def test_per_device_loop_equals_the_compiler_loop_with_moe_balancing_losses():
  """MoE with both balancing losses (nonlinear in the whole microbatch: the per-device loop computes them from the
  taps all-gathered over every batch axis, each device adding 1/devices of them; the experts are each device's
  blocks, sent tokens by all-to-all inside the loop): loss, gradients and the sparse-layer stats
  of the per-device loop equal the compiler's loop (param_specs not given) at microbatches=2, to 64 eps32 of each
  leaf's largest element."""
  config = mesh_config(microbatches=2, ffn_type="moe")
  config.model.ffn.update(aux_loss=0.1, router_z_loss=0.01)
  built = state_lib.setup(config, jax.devices()[:8])
  params = state_lib.create_state(config, built.shardings, built.model, built.tx).params
  batch = jax.device_put(synthetic_batch(config), built.batch_sharding)
  specs = jax.tree.map(lambda sharding: sharding.spec, built.shardings.params)
  assert logical_rules.per_device_axes(built.mesh, config.mesh.rules) == ("data", "expert")
  results = []
  for param_specs in (specs, None):
    run = jax.jit(
      lambda p, b: step_lib.loss_and_grads(p, b, model=built.model, train=config.train, param_specs=param_specs),  # noqa: B023
      in_shardings=(built.shardings.params, built.batch_sharding),
    )
    with logical_rules.activate(built.mesh, config.mesh.rules):
      results.append(jax.device_get(run(params, batch)))
  (loss, grads, tokens, stats), (want_loss, want_grads, want_tokens, want_stats) = results
  assert tokens == want_tokens and stats.keys() == want_stats.keys() and "sparse/layers_0/aux_loss" in stats
  np.testing.assert_allclose(loss, want_loss, rtol=16 * EPS32)
  for name in stats:
    np.testing.assert_allclose(stats[name], want_stats[name], rtol=16 * EPS32, err_msg=name)
  for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, want, atol=64 * EPS32 * float(np.abs(want).max()), rtol=0, err_msg=str(path))


def test_loop_param_bytes_counts_the_tables_blocks_and_every_other_parameter_whole():
  """What the device memory estimate reads (plan/memory.device_memory): on data=2 x expert=4 with 2 microbatches the loop
  holds sgatlin's table as its channel block (1/4: expert splits the channels, fsdp=1 leaves d_model whole) and
  every other parameter whole, the vocabulary's too; without microbatches, the parameters as stored."""
  config = mesh_config(microbatches=2)
  built = state_lib.setup(config, jax.devices()[:8])
  params = built.abstract_state.params
  whole = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
  table = params["layers_0"]["mlp"]["experts"]
  assert table.sharding.spec[1] == "expert"
  want = whole - table.size * table.dtype.itemsize * 3 // 4
  assert step_lib.loop_param_bytes(config, built.model, params, built.mesh) == want
  config.train.microbatches = 1
  assert step_lib.loop_param_bytes(config, built.model, params, built.mesh) == aot.device_bytes(params)
  assert aot.device_bytes(params) < want

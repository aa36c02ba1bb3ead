"""Table placement (config.model.ffn.placement; sparsetx/parallel/sparse_forms.py, sparsetx/plan/layer_cost.py): the
fsdp and data placements equal the single-device layer in values and gradients on 8 simulated devices, store and
move their tables as they claim (the compiled program's collectives), and `auto` picks the placement that sends the
fewest bytes by docs/expert_parallel.md's formulas (checked against hand-computed numbers)."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import SPARSE_LAYERS_OF_8, init_params

from sparsetx import config as config_lib
from sparsetx.models.ffn.registry import FFN_LAYERS
from sparsetx.parallel import logical_rules
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.plan import placement_plans, step_cost
from sparsetx.train import state as state_lib

D = 16
LAYERS = SPARSE_LAYERS_OF_8
TABLE = {"sgatlin": ("experts",), "peer": ("experts",), "fff": ("w_in", "w_out"), "moe": ("wi_gate", "wi_up", "wo")}


def model_config(ffn_type, placement):
  config = config_lib.default_config()
  config.model.update(d_model=D, head_dim=D, dtype="float32")
  config.model.ffn.type = ffn_type
  config.model.ffn.update(LAYERS[ffn_type], placement=placement)
  config_lib.validate(config)
  return ml_collections.FrozenConfigDict(config.model)


def make_mesh(**axes):
  config = config_lib.default_config().mesh
  config.ici.update(data=1, fsdp=1, tensor=1, expert=1)
  config.ici.update(axes)
  return mesh_lib.make_mesh(config)


def forward_and_grads(apply, probe, params, x):
  y = apply(params, x)
  grads = jax.grad(lambda p, x: jnp.sum(jnp.sin(apply(p, x)) * probe), argnums=(0, 1))(params, x)
  return y, grads


@functools.cache
def single_device(ffn_type):
  """(params, x, probe, (values, gradients)) of the layer on one device (the expert placement's plain form)."""
  layer = FFN_LAYERS[ffn_type](model_config(ffn_type, "expert"))
  x = jax.random.normal(jax.random.key(1), (8, 4, D))
  params = init_params(layer, x)
  if ffn_type == "moe":
    params["router"]["kernel"] = params["router"]["kernel"] * 50  # spread tokens over every expert
  probe = jax.random.normal(jax.random.key(2), (8, 4, D))
  apply = lambda p, x: layer.apply({"params": p}, x)  # noqa: E731
  return params, x, probe, jax.device_get(jax.jit(functools.partial(forward_and_grads, apply, probe))(params, x))


def placed(ffn_type, placement, mesh, grads=True):
  """(values and gradients, the compiled program, the parameters' shardings) of the placed layer on the mesh."""
  params, x, probe, _ = single_device(ffn_type)
  layer = FFN_LAYERS[ffn_type](model_config(ffn_type, placement))
  rules = config_lib.DEFAULT_RULES
  boxed = jax.eval_shape(layer.init, jax.random.key(0), x)["params"]
  shardings = mesh_lib.logical_sharding(nn.get_partition_spec(boxed), mesh, rules)
  x_sharded = jax.device_put(x, mesh_lib.batch_sharding(mesh, rules))
  apply = lambda p, x: layer.apply({"params": p}, x)  # noqa: E731
  fn = functools.partial(forward_and_grads, apply, probe) if grads else apply
  with logical_rules.activate(mesh, rules):
    compiled = jax.jit(fn).lower(jax.device_put(params, shardings), x_sharded).compile()
    out = compiled(jax.device_put(params, shardings), x_sharded)
  return out, compiled, shardings


def table_specs(ffn_type, shardings):
  return [shardings[name].spec for name in TABLE[ffn_type]]


# Every type's fsdp on data=2 x expert=4 (tables gathered over two axes); data there, and FFF's on expert=8.
CASES = [(t, "fsdp", "data2_expert4") for t in LAYERS] + [
  (t, "data", "data2_expert4") for t in ("sgatlin", "peer", "moe")
]
CASES += [("fff", "data", "expert8")]
MESHES = {"data2_expert4": dict(data=2, expert=4), "expert8": dict(expert=8)}


@pytest.mark.parametrize("ffn_type, placement, mesh_name", CASES)
def test_placed_layer_equals_the_single_device_layer(ffn_type, placement, mesh_name):
  """Values and gradients (params and x) within float32 reordering: 1e-5 of each gradient's largest entry; the
  tables stored as placed (fsdp: d_model over every batch axis; data: whole on every device)."""
  *_, (want_y, want_grads) = single_device(ffn_type)
  mesh = make_mesh(**MESHES[mesh_name])
  (y, grads), _, shardings = placed(ffn_type, placement, mesh)
  np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
  for (path, g), w in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads)):
    scale = np.abs(w).max() + 1e-6
    np.testing.assert_allclose(g / scale, w / scale, rtol=1e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))
  for spec in table_specs(ffn_type, shardings):
    entries = [e for e in spec if e is not None]
    if placement == "data":
      assert not entries, spec
    else:
      assert entries == [("data", "fsdp", "expert")], spec


def collectives(text):
  """[(op, result shapes)] of the compiled program's collectives."""
  found = []
  for line in text.splitlines():
    match = re.search(r"= (\(.*?\)|\S+) (all-gather|reduce-scatter|all-reduce|all-to-all)(?:-start)?\(", line)
    if match:
      found.append((match[2], re.findall(r"\w+\[([\d,]*)\]", match[1])))
  return found


def test_each_placement_moves_its_table_as_it_claims():
  """sgatlin's table [2, C=8, F=36, D=16] on data=2 x expert=4 (8 batch shards). fsdp: the forward all-gathers the
  table whole (result [2, 8, 36, 16]) and nothing reduces it; the backward reduce-scatters its gradient to the
  device's d_model shard ([2, 8, 36, 2]). data: no collective of the table in the forward, and in the step the
  gradient of the whole table is all-reduced, never gathered or scattered."""
  mesh = make_mesh(data=2, expert=4)
  whole, shard = "2,8,36,16", "2,8,36,2"

  def table_ops(compiled):
    return {(op, shape) for op, shapes in collectives(compiled.as_text()) for shape in shapes if shape[:7] == "2,8,36,"}

  _, fsdp_forward, _ = placed("sgatlin", "fsdp", mesh, grads=False)
  assert ("all-gather", whole) in table_ops(fsdp_forward)
  assert not {op for op, _ in table_ops(fsdp_forward)} - {"all-gather"}
  _, fsdp_step, _ = placed("sgatlin", "fsdp", mesh)
  assert {("all-gather", whole), ("reduce-scatter", shard)} <= table_ops(fsdp_step)
  assert not {op for op, _ in table_ops(fsdp_step)} - {"all-gather", "reduce-scatter"}

  _, data_forward, _ = placed("sgatlin", "data", mesh, grads=False)
  assert not table_ops(data_forward)
  _, data_step, _ = placed("sgatlin", "data", mesh)
  assert table_ops(data_step) == {("all-reduce", whole)}


# Byte formulas (docs/expert_parallel.md, "Table placement"), by hand --------------------------------------------


def cost_config(remat="full", microbatches=2):
  """sgatlin D=64, C=4 channels, d_ffw=64, k=2, bf16, on data=2 x expert=4: 32 rows x 64 tokens = 256 own tokens
  per device; channels over expert (E=4, one channel a device), d_model whole (fsdp=1)."""
  config = config_lib.default_config()
  config.model.update(d_model=64, head_dim=64, dtype="bfloat16", remat=remat)
  config.model.ffn.update(type="sgatlin", n_channels=4, d_ffw=64, top_k=2, d_key=16)
  config.data.update(seq_len=64, global_batch_size=32, eval_batch_size=32)
  config.train.microbatches = microbatches
  config.mesh.ici.update(data=2, fsdp=1, tensor=1, expert=4)
  return config_lib.validate(config)


SHAPE = dict(data=2, fsdp=1, tensor=1, expert=4)


def sent(config):
  return {p: o.nbytes for p, o in step_cost.placement_options(config, config.model.ffn, SHAPE).items()}


def test_placement_bytes_by_hand():
  """remat=full (forward collectives twice), 2 micro-batches. The step's loop runs per device along every batch
  axis (data, expert), so every gradient is reduced once a step and a gathered table is gathered once, before the
  loop. The table: 2 x 4 x 64 x 64 = 32,768 float32.

  expert (E = 4, n = 256, b = 2): x all-gather 3/4 x 256 x 4 x 64 x 2 twice; indices and gates 3/4 x 256 x 4 x 2
  x 8 twice; y reduce-scatter 3 x 256 x 64 x 4 twice; dy 3/4 x 256 x 4 x 64 x 2; dx 3 x 256 x 64 x 4; gate
  gradients 3/4 x 256 x 4 x 2 x 4; the device's channel (8,192 float32) all-reduced over data's 2 once.
  fsdp (8 shards): 7/8 of the table gathered once, its gradient reduce-scattered (7 x 1/8 of it) once. data:
  all-reduced over all 8 once (2 x 7/8 of it): it ties fsdp, which the tie order prefers."""
  table = 32768 * 4
  expert = (
    2 * 3 / 4 * 256 * 4 * 64 * 2
    + 2 * 3 / 4 * 256 * 4 * 2 * 8
    + 2 * 3 * 256 * 64 * 4
    + 3 / 4 * 256 * 4 * 64 * 2
    + 3 * 256 * 64 * 4
    + 3 / 4 * 256 * 4 * 2 * 4
    + 2 * 1 / 2 * 8192 * 4
  )
  fsdp = 7 / 8 * table + 7 * table / 8
  data = 2 * 7 / 8 * table
  assert (expert, fsdp, data) == (948224, 229376, 229376)
  config = cost_config()
  assert sent(config) == pytest.approx(dict(expert=expert, fsdp=fsdp, data=data), rel=1e-12)
  assert step_cost.choose_placement(config, config.model.ffn, SHAPE)[0] == "fsdp"

  # One micro-batch, remat=full: fsdp gathers inside the layer, again in the backward; data's all-reduce wins.
  config = cost_config(microbatches=1)
  assert sent(config)["fsdp"] == pytest.approx(2 * 7 / 8 * table + 7 * table / 8)
  assert step_cost.choose_placement(config, config.model.ffn, SHAPE)[0] == "data"

  # remat=none and one micro-batch: every collective once; data's single all-reduce over all 8 (2 x 7/8) ties
  # fsdp's gather and reduce-scatter (7/8 each), and expert leads the ties, then fsdp.
  config = cost_config(remat="none", microbatches=1)
  one_pass = 3 / 4 * 256 * 4 * 64 * 2 + 3 / 4 * 256 * 4 * 2 * 8 + 3 * 256 * 64 * 4
  one_pass += 3 / 4 * 256 * 4 * 64 * 2 + 3 * 256 * 64 * 4 + 3 / 4 * 256 * 4 * 2 * 4 + 2 * 1 / 2 * 8192 * 4
  assert sent(config) == pytest.approx(dict(expert=one_pass, fsdp=2 * 7 / 8 * table, data=2 * 7 / 8 * table))
  assert step_cost.choose_placement(config, config.model.ffn, SHAPE)[0] == "fsdp"


def test_the_config_overrides_auto_and_the_state_is_laid_out_as_chosen():
  """auto resolves to fsdp here (above); placement=expert keeps the channel split though it sends more. The
  trainer's state (state_shardings) stores the table as resolved: d_model over every batch axis under auto
  (fsdp), channels over expert under expert. The dry run's table names each placement's bytes and the chosen
  one."""
  mesh = jax.sharding.AbstractMesh((2, 1, 1, 4), config_lib.MESH_AXES)
  config = cost_config()
  assert step_cost.resolve_placements(config, SHAPE).model.ffn.placement == "fsdp"
  assert config.model.ffn.placement == "auto"  # resolved on a copy
  _, shardings, _, _ = state_lib.state_shardings(config, mesh)
  batch = ("data", "fsdp", "expert")
  assert shardings.params["layers_0"]["mlp"]["experts"].spec == jax.sharding.PartitionSpec(None, None, None, batch)
  text = step_cost.format_placements(config, SHAPE)
  assert re.search(r"fsdp\s+0\.2 MB  <- chosen \(auto: fewest bytes\)\n\s+data\s+0\.2 MB$", text), text
  assert re.search(r"expert\s+0\.9 MB\n", text), text

  config.model.ffn.placement = "expert"
  assert step_cost.choose_placement(config, config.model.ffn, SHAPE)[0] == "expert"
  _, shardings, _, _ = state_lib.state_shardings(config, mesh)
  assert shardings.params["layers_0"]["mlp"]["experts"].spec == jax.sharding.PartitionSpec(None, "expert", None, "fsdp")
  assert "<- chosen (config.model.ffn.placement)" in step_cost.format_placements(config, SHAPE)


def test_bad_placements_are_refused_in_one_sentence():
  config = cost_config()
  config.model.ffn.placement = "zero3"
  with pytest.raises(
    config_lib.ConfigError, match=r"^config.model.ffn.placement='zero3' is unknown; use one of 'auto', 'expert', "
  ):
    config_lib.validate(config)
  config = cost_config()
  config.model.update(d_model=60, head_dim=60)
  config.model.ffn.placement = "fsdp"
  with pytest.raises(
    config_lib.ConfigError, match=r"placement='fsdp' splits the tables' d_model=60 over the 8 devices"
  ):
    state_lib.checked_mesh(config, jax.devices()[:8])


def test_fsdp_is_refused_when_the_loop_would_hold_too_much_of_the_tables():
  """With micro-batches the per-device loop holds each table whole with two float32 gradient sums. Counted by the
  layer's parameters (placement_plans.table_mib: the table 2 x 4 x 64 x 64 and the router's query 64 x 16 and keys
  16 x 2 x 4 x 8 float32): 4 layers x 34,816 x 12 bytes = 1.59375 MiB here, against half the HBM the replication
  limit stands for (512 x the limit / 2). At a limit of 1/200 MiB (1.28 MiB of budget) auto falls back from fsdp
  to expert; one micro-batch (no such loop) lifts the refusal."""
  config = cost_config()
  config.mesh.max_replicated_mib = 1 / 200
  assert config.model.n_layers == 4
  assert placement_plans.held_tables_gib(config, config.model.ffn) * 1024 == pytest.approx(1.59375)
  options = step_cost.placement_options(config, config.model.ffn, SHAPE)
  assert options["fsdp"].refused.startswith("the micro-batch loop would hold 0.0 GiB of whole tables"), options
  assert step_cost.choose_placement(config, config.model.ffn, SHAPE)[0] == "expert"
  config.train.microbatches = 1
  assert not step_cost.placement_options(config, config.model.ffn, SHAPE)["fsdp"].refused

"""Mesh construction, logical shardings and the replicated-parameter check."""

import jax
import pytest
from conftest import load_config

from sparsetx import config as config_lib
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import state as state_lib


def test_one_axis_is_inferred_and_sizes_must_divide():
  config = config_lib.default_config()
  config.mesh.ici.update(data=-1, fsdp=2, expert=2)
  assert dict(mesh_lib.make_mesh(config.mesh).shape) == dict(data=2, fsdp=2, tensor=1, expert=2)
  config.mesh.ici.update(data=4, fsdp=4, expert=1)
  with pytest.raises(
    config_lib.ConfigError, match=r"config.mesh.ici \(data=4, fsdp=4, tensor=1, expert=1\) does not divide 8"
  ):
    mesh_lib.make_mesh(config.mesh)
  config.mesh.ici.update(data=-1, fsdp=-1)
  with pytest.raises(config_lib.ConfigError, match="more than one -1"):
    config_lib.validate_mesh(config.mesh)


def test_sparse_tables_follow_the_expert_axis_and_batch_all_batch_axes():
  config = load_config("configs/tiny.py", "sgatlin")
  config.mesh.ici.update(data=2, fsdp=2, expert=2)
  mesh = mesh_lib.make_mesh(config.mesh)
  abstract, shardings, _, _ = state_lib.state_shardings(config, mesh)
  experts = shardings.params["layers_0"]["mlp"]["experts"]
  assert tuple(experts.spec) == (None, "expert", None, "fsdp")
  assert tuple(shardings.opt_state[1][0].mu["layers_0"]["mlp"]["experts"].spec) == (None, "expert", None, "fsdp")
  assert tuple(mesh_lib.batch_sharding(mesh, config.mesh.rules).spec) == (("data", "fsdp", "expert"), None)
  shard_shape = experts.shard_shape(abstract.params["layers_0"]["mlp"]["experts"].shape)
  assert shard_shape == (2, 2, 1024, 64)  # C=4 over expert=2, d_model=128 over fsdp=2


def test_a_large_replicated_parameter_is_refused_by_name():
  config = load_config("configs/tiny.py", "sgatlin")
  config.mesh.rules = tuple((name, None if name in ("channel", "embed") else axes) for name, axes in config.mesh.rules)
  config.mesh.max_replicated_mib = 1.0
  mesh = mesh_lib.make_mesh(config.mesh)
  with pytest.raises(
    config_lib.ConfigError, match=r"parameter .*'experts'.* \(4 MiB\) would be fully replicated on all 8"
  ):
    state_lib.state_shardings(config, mesh)
  single = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
  state_lib.state_shardings(config, single)  # one device: nothing to refuse

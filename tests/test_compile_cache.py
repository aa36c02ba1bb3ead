"""The trainer's compilation cache (sparsetx/train/run/compile_cache.py) is the run's only: a program compiled inside
`used` is written to the run's directory, one compiled after it is not and JAX's setting is as before; a directory
the caller set is left alone; an unwritable directory is one sentence."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from sparsetx import config as config_lib
from sparsetx.train.run import compile_cache

_SETTINGS = (
  "jax_compilation_cache_dir",
  "jax_persistent_cache_min_compile_time_secs",
  "jax_persistent_cache_min_entry_size_bytes",
)


@pytest.fixture
def no_session_cache():
  """The suite's cache (conftest.py) set aside, with JAX's open cache object; every program, however small and
  quick, is written when a cache is on. All put back after."""
  saved = {name: getattr(jax.config, name) for name in _SETTINGS}
  jax.config.update("jax_compilation_cache_dir", None)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax_cache.reset_cache()
  yield
  for name, value in saved.items():
    jax.config.update(name, value)
  jax_cache.reset_cache()


def files_in(directory) -> set[str]:
  return {str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file()}


def test_the_cache_is_on_inside_used_and_off_after(tmp_path, no_session_cache):
  train = config_lib.default_config().train
  cache = tmp_path / "run" / compile_cache.DEFAULT_NAME
  with compile_cache.used(train, str(tmp_path / "run")) as found:
    assert found == str(cache) and jax.config.jax_compilation_cache_dir == str(cache)
    jax.jit(lambda x: x * 3.0 + 1.0)(jnp.arange(7.0)).block_until_ready()  # shapes no other test compiles
  written = files_in(cache)
  assert written  # the run's program is in its cache
  assert jax.config.jax_compilation_cache_dir is None
  jax.jit(lambda x: x * 5.0 - 2.0)(jnp.arange(11.0)).block_until_ready()
  assert files_in(cache) == written  # compiled after the run: not written there

  with pytest.raises(RuntimeError, match="the run failed"), compile_cache.used(train, str(tmp_path / "run")):
    raise RuntimeError("the run failed")
  assert jax.config.jax_compilation_cache_dir is None  # restored on an error too


def test_a_directory_set_before_is_used_and_left_alone(tmp_path, no_session_cache):
  callers = str(tmp_path / "callers")
  jax.config.update("jax_compilation_cache_dir", callers)
  with compile_cache.used(config_lib.default_config().train, str(tmp_path / "run")) as found:
    assert found == callers
  assert jax.config.jax_compilation_cache_dir == callers and not (tmp_path / "run").exists()


def test_an_unwritable_compilation_cache_is_one_line(tmp_path, no_session_cache):
  (tmp_path / "file").write_text("")
  train = config_lib.default_config().train
  train.compilation_cache_dir = str(tmp_path / "file" / "cache")
  with pytest.raises(config_lib.ConfigError, match=r"compilation_cache_dir='.*file/cache' is not writable"):
    with compile_cache.used(train, str(tmp_path)):
      pass
  assert jax.config.jax_compilation_cache_dir is None
  train.compilation_cache = False
  with compile_cache.used(train, str(tmp_path)) as found:
    assert found is None and jax.config.jax_compilation_cache_dir is None
  train.compilation_cache, train.compilation_cache_dir = True, ""
  assert compile_cache.directory(train, str(tmp_path)) == str(tmp_path / "compilation_cache")


def test_a_compile_for_devices_this_machine_lacks_leaves_the_cache_alone(tmp_path, no_session_cache):
  """A TPU topology's program is neither written to nor read from a cache that is on (JAX reads an entry back
  through a device client, which a compile-only one lacks); a local program still is, after it."""
  from sparsetx.measure import aot  # noqa: PLC0415
  from sparsetx.parallel import topology  # noqa: PLC0415

  cache = tmp_path / "cache"
  jax.config.update("jax_compilation_cache_dir", str(cache))
  mesh = jax.sharding.Mesh(topology.devices("v5p:2x2x1"), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=sharding)
  traced = jax.jit(lambda x: jnp.sin(x) * 2.0).trace(x)
  assert aot.compile_traced(traced, mesh).as_text()  # compiled by libtpu
  assert not cache.exists() or not files_in(cache)
  local = jax.sharding.Mesh(jax.devices(), ("data",))
  y = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=jax.sharding.NamedSharding(local, sharding.spec))
  aot.compile_traced(jax.jit(lambda x: jnp.cos(x) * 3.0).trace(y), local)
  assert files_in(cache)  # the cache was on all along

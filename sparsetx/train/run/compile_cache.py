"""JAX's persistent compilation cache for the trainer: a restart (a preemption, the watchdog, a rollback's rerun)
reads the compiled step instead of compiling it again (MaxText and Levanter keep one too).

The cache is config.train.compilation_cache_dir, by default <workdir>/compilation_cache (a gs:// workdir gives a
gs:// cache, which JAX reads and writes through etils); JAX_COMPILATION_CACHE_DIR in the environment wins. It is on
for the run that asked for it only (`used`, as the logging filters are): other programs of the process (a test
suite's deviceless compiles, an evaluation after training) compile as before.
"""

import contextlib

import jax
import ml_collections
from absl import logging
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from sparsetx import config as config_lib
from sparsetx import paths

DEFAULT_NAME = "compilation_cache"
# What a run changes: the directory, and the entry-size floor JAX's cache writes when it first opens (at 0).
_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_entry_size_bytes")


def directory(train: ml_collections.ConfigDict, workdir: str) -> str | None:
  """Where the trainer's cache is: None when config.train.compilation_cache is off."""
  if not train.get("compilation_cache", True):
    return None
  return train.get("compilation_cache_dir") or str(paths.resolve(workdir) / DEFAULT_NAME)


@contextlib.contextmanager
def used(train: ml_collections.ConfigDict, workdir: str):
  """The cache on inside the block (enter before anything compiles), after checking that it takes a file; yields its
  directory (None when off). An unwritable directory is a ConfigError naming the field. A directory set before (by
  JAX_COMPILATION_CACHE_DIR or the caller) is used and left as it was."""
  found = jax.config.jax_compilation_cache_dir
  if found:
    yield found
    return
  wanted = directory(train, workdir)
  if wanted is None:
    yield None
    return
  try:
    paths.check_writable(wanted, f".write_probe_{jax.process_index()}")
  except paths.storage_errors() as error:
    raise config_lib.ConfigError(
      f"config.train.compilation_cache_dir={wanted!r} is not writable ({paths.reason(error)}); give a directory "
      "you can write to, or set config.train.compilation_cache=False."
    ) from None
  before = {name: getattr(jax.config, name) for name in _SETTINGS}
  # JAX opens its cache object once, at the first compile that finds a directory set, and keeps it (and whether
  # the cache is used) for the process: a config change alone reaches no later compile. reset_cache (JAX's own
  # jax.experimental.compilation_cache API) drops that object, so the next compile opens the directory set now.
  jax_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", wanted)
  logging.info("Compiled programs are cached in %s: a restart reads them instead of compiling.", wanted)
  try:
    yield wanted
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
    jax_cache.reset_cache()  # else the next compile still reads and writes this run's directory


@contextlib.contextmanager
def off():
  """No persistent cache inside the block: a compile for devices this machine lacks (a TPU topology, a GPU node)
  cannot read a cache entry back (JAX deserializes through a device client, which a compile-only one lacks), and
  writing one only fills the cache with programs no run here will load."""
  before = jax.config.jax_enable_compilation_cache
  jax_cache.reset_cache()
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", before)
    jax_cache.reset_cache()

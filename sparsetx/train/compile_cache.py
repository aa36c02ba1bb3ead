"""JAX's persistent compilation cache for the trainer: a restart (a preemption, the watchdog, a rollback's rerun)
reads the compiled step instead of compiling it again (MaxText and Levanter keep one too).

The cache is config.train.compilation_cache_dir, by default <workdir>/compilation_cache (a gs:// workdir gives a
gs:// cache, which JAX reads and writes through etils); JAX_COMPILATION_CACHE_DIR in the environment wins.
"""

import jax
import ml_collections
from absl import logging

from sparsetx import config as config_lib
from sparsetx import paths

DEFAULT_NAME = "compilation_cache"


def directory(train: ml_collections.ConfigDict, workdir: str) -> str | None:
  """Where the trainer's cache is: None when config.train.compilation_cache is off."""
  if not train.get("compilation_cache", True):
    return None
  return train.get("compilation_cache_dir") or str(paths.resolve(workdir) / DEFAULT_NAME)


def use(train: ml_collections.ConfigDict, workdir: str) -> str | None:
  """Turns the cache on (before anything compiles), after checking that it takes a file; returns its directory.
  An unwritable directory is a ConfigError naming the field."""
  found = jax.config.jax_compilation_cache_dir
  if found:  # set by the environment (JAX_COMPILATION_CACHE_DIR) or the caller
    return found
  wanted = directory(train, workdir)
  if wanted is None:
    return None
  try:
    paths.check_writable(wanted, f".write_probe_{jax.process_index()}")
  except paths.storage_errors() as error:
    raise config_lib.ConfigError(
      f"config.train.compilation_cache_dir={wanted!r} is not writable ({paths.reason(error)}); give a directory "
      "you can write to, or set config.train.compilation_cache=False."
    ) from None
  jax.config.update("jax_compilation_cache_dir", wanted)
  logging.info("Compiled programs are cached in %s: a restart reads them instead of compiling.", wanted)
  return wanted

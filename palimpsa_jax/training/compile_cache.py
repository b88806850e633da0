"""JAX's persistent compilation cache (on by default in train.py and eval.py) and timed compiles.

A compiled XLA program is written to the cache directory and read back by the next process that
compiles the same program (same code, shapes, shardings, JAX version and device), which then skips
XLA's compile. The default directory is $XDG_CACHE_HOME/palimpsa_jax/jax_cache (~/.cache/... when
XDG_CACHE_HOME is unset); `--compilation_cache_dir DIR` moves it and `--compilation_cache_dir=`
(empty) turns the cache off.
"""

from collections.abc import Callable
import contextlib
import dataclasses
import os
import time
from typing import Any

from absl import flags
import jax

CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def default_cache_dir() -> str:
  """$XDG_CACHE_HOME/palimpsa_jax/jax_cache, or ~/.cache/palimpsa_jax/jax_cache."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "palimpsa_jax", "jax_cache")


def define_flag() -> flags.FlagHolder[str]:
  """Defines --compilation_cache_dir (for a command's main module)."""
  return flags.DEFINE_string(
      "compilation_cache_dir", default_cache_dir(),
      "Directory of JAX's persistent compilation cache (a later start of the same config "
      "skips the XLA compile); empty (--compilation_cache_dir=) turns it off.")


def configure(directory: str) -> str | None:
  """Turns the persistent compilation cache on at `directory`, or off for "".

  Every compiled program is cached, however short its compile and small its size (JAX's
  defaults skip programs that compile in under a second, which leaves CPU runs uncached).
  Call it before the first compile of the process.

  Returns:
    The absolute cache directory, or None when the cache is off.
  """
  if not directory:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  directory = os.path.abspath(os.path.expanduser(directory))
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    raise ValueError(f"--compilation_cache_dir={directory!r} cannot be created: {e}") from e
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return directory


@dataclasses.dataclass(frozen=True)
class CompileTiming:
  """Wall seconds of an ahead-of-time compile.

  Attributes:
    lower_s: tracing the Python function and lowering it to StableHLO.
    compile_s: XLA's compile, or reading the program from the persistent cache.
    cache_hits: programs read from the persistent cache during the compile.
  """

  lower_s: float
  compile_s: float
  cache_hits: int


@contextlib.contextmanager
def _counting_cache_hits():
  hits = []
  def listener(event: str, **_):
    if event == CACHE_HIT_EVENT:
      hits.append(event)
  jax.monitoring.register_event_listener(listener)
  try:
    yield hits
  finally:
    jax.monitoring.unregister_event_listener(listener)


def compile_timed(jitted: Callable[..., Any], *args) -> tuple[Any, CompileTiming]:
  """(jitted.lower(*args).compile(), its timing); `args` are only read for shapes/shardings."""
  with _counting_cache_hits() as hits:
    start = time.perf_counter()
    lowered = jitted.lower(*args)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
  return compiled, CompileTiming(lowered_at - start, done - lowered_at, len(hits))

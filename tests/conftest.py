"""Fixtures shared by the whole test suite."""

import gc
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile

import jax
import pytest

REPO = pathlib.Path(__file__).parents[1]

_CACHE_SETTINGS = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
                   "jax_persistent_cache_min_compile_time_secs",
                   "jax_persistent_cache_min_entry_size_bytes")


def pytest_configure(config):
  """Points $XDG_CACHE_HOME (train.py's default compilation cache) at a fresh directory.

  No test then reads or fills the user's cache. A program read back from a cache keeps the
  source paths of the checkout that compiled it first, so a cache shared across clones would
  also give the profilers' source column another checkout's paths.
  """
  config.palimpsa_cache_home = tempfile.mkdtemp(prefix="palimpsa_test_cache_")
  os.environ["XDG_CACHE_HOME"] = config.palimpsa_cache_home


@pytest.hookimpl(trylast=True)  # after the session's fixtures are torn down
def pytest_sessionfinish(session):
  """In an xdist worker: the tests' last garbage is collected before the worker reports that
  it finished, and the SIGINT that xdist may send afterwards is ignored.

  Once every worker has reported, xdist (execnet) asks each to exit, and sends SIGINT to one
  still busy 5 s later. Left to pytest's collection at unconfigure, the garbage of a whole
  run (JAX's XLA buffers and executables, grain's thread pools) can take longer than that on a
  busy machine, and the SIGINT then lands in one of their finalisers: an unraisable
  KeyboardInterrupt printed after the results. What remains after the report is short, and
  nothing in it is worth interrupting.
  """
  del session
  if os.environ.get("PYTEST_XDIST_WORKER"):
    gc.collect()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def pytest_unconfigure(config):
  shutil.rmtree(getattr(config, "palimpsa_cache_home", ""), ignore_errors=True)


@pytest.fixture(autouse=True)
def _restore_compilation_cache_settings():
  """Undoes a test's compile_cache.configure (train.py's and eval.py's main call it)."""
  saved = {name: getattr(jax.config, name) for name in _CACHE_SETTINGS}
  yield
  for name, value in saved.items():
    jax.config.update(name, value)


def _run_on_cpu_devices(script: str, devices: int, timeout: float = 300
                        ) -> subprocess.CompletedProcess:
  """Runs the Python source `script` in a fresh process that has `devices` CPU devices.

  JAX fixes its device count when it first initialises a backend, which this test process (and
  every xdist worker) has done long before a multi-device test runs. So the script runs in a
  new process whose first statement is chex.set_n_cpu_devices(devices), with JAX on the CPU.
  The working directory is the repository root; stdout and stderr are captured as text.
  """
  prelude = f"import chex\nchex.set_n_cpu_devices({devices})\n"
  return subprocess.run([sys.executable, "-c", prelude + script],
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def run_on_cpu_devices():
  """`run(script, devices, timeout=300) -> subprocess.CompletedProcess` (see above)."""
  return _run_on_cpu_devices

"""Fixtures shared by the whole test suite."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).parents[1]


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

"""Two processes on localhost (jax.distributed, CPU): host init, training, checkpoints."""

import os
import pathlib
import socket
import subprocess
import sys

from palimpsa_jax.training import metrics as metrics_lib

REPO = pathlib.Path(__file__).parents[2]

_PROCESS = """
import chex
chex.set_n_cpu_devices(1)  # One device per process, whatever XLA_FLAGS the parent has.
import jax
jax.distributed.initialize(coordinator_address={address!r}, num_processes=2,
                           process_id={process_id})
assert jax.process_count() == 2 and jax.device_count() == 2
import pytest
from palimpsa_jax.training import trainer
from tests.training import tiny_lm
tiny_lm.use_tiny_model(pytest.MonkeyPatch())
config = tiny_lm.resumable_mqar_config(8)
config.init_on_host = True  # Each process places its shards of the host copy.
trainer.train_and_evaluate(config, {workdir!r})
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_process_run_completes_and_checkpoints(tmp_path):
  address = f"localhost:{_free_port()}"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  processes = [
      subprocess.Popen(
          [sys.executable, "-c", _PROCESS.format(
              address=address, process_id=i, workdir=str(tmp_path))],
          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  outputs = [p.communicate(timeout=300)[0] for p in processes]
  assert [p.returncode for p in processes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
  assert "final: best eval accuracy" in outputs[0]
  assert "final:" not in outputs[1]  # Only process 0 reports.
  data = tmp_path / "checkpoints" / "8" / "data"
  assert sorted(f for f in os.listdir(data) if f.endswith(".json")) == [
      "process_0-of-2.json", "process_1-of-2.json"]
  steps = [r["step"] for r in metrics_lib.read_metrics(str(tmp_path))]
  assert steps == [1, 2, 4, 6, 8]  # 1: the start-up timings

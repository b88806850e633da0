"""train.py with config.mesh.sequence > 1 gives the losses of config.mesh.sequence=1.

Real Palimpsa-D on MQAR, 4 fake CPU devices: 8 steps data-parallel (sequence 1) against
4 steps with every sequence split over 4 devices, resumed from that checkpoint on a
sequence axis of 2 for the last 4 steps.
"""

import json

import chex
import pytest

_CONFIG = ("--config=configs/mqar.py:model=palimpsa_d,seq_len=16,num_kv_pairs=2,vocab_size=32,"
           "d_model=16,num_heads=2,head_v_dim=8,num_train_examples=64,num_test_examples=32,"
           "batch_size=16,num_epochs=2")
_FLAGS = ("--config.eval_batch_size=32", "--config.log_every_steps=1",
          "--config.eval_every_steps=4", "--config.checkpoint_every_steps=4",
          "--config.optimizer.decay_steps=16", "--config.log_diagnostics=False")


def _train(run_on_cpu_devices, workdir, total_steps, sequence):
  argv = ["train.py", _CONFIG, *_FLAGS, f"--config.total_steps={total_steps}",
          f"--config.mesh.sequence={sequence}", f"--workdir={workdir}"]
  script = f"import runpy, sys\nsys.argv = {argv!r}\nrunpy.run_path('train.py', run_name='__main__')\n"
  result = run_on_cpu_devices(script, 4, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def _losses(workdir):
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
  return {r["step"]: (r["train/loss"], r["train/grad_norm"]) for r in records
          if "train/loss" in r}


@pytest.mark.slow  # three train.py runs: about a minute of CPU
def test_sequence_axis_gives_the_losses_of_one_and_restores_onto_another_size(
    tmp_path, run_on_cpu_devices):
  _train(run_on_cpu_devices, tmp_path / "whole", 8, sequence=1)
  split = tmp_path / "split"
  _train(run_on_cpu_devices, split, 4, sequence=4)
  out = _train(run_on_cpu_devices, split, 8, sequence=2)
  assert "resumed from" in out
  want, got = _losses(tmp_path / "whole"), _losses(split)
  assert sorted(got) == sorted(want) == list(range(1, 9))
  chex.assert_trees_all_close([got[s] for s in range(1, 9)], [want[s] for s in range(1, 9)],
                              rtol=1e-5, atol=0.0)


def test_batch_and_kernel_context_follow_the_sequence_axis():
  from jax.sharding import AbstractMesh, PartitionSpec  # pylint: disable=g-import-not-at-top
  from palimpsa_jax.ops import kernel_sharding  # pylint: disable=g-import-not-at-top
  from palimpsa_jax.training import sharding  # pylint: disable=g-import-not-at-top
  mesh = AbstractMesh((1, 1, 4, 1), sharding.MESH_AXES)
  spec = lambda shape: sharding.batch_sharding(mesh, shape).spec
  assert spec((2, 16)) == PartitionSpec(sharding.BATCH_AXES, "sequence")
  assert spec((2, 6)) == spec((2,)) == PartitionSpec(sharding.BATCH_AXES)
  with sharding.kernel_context(mesh, sharding.DEFAULT_RULES)():
    assert kernel_sharding.current().sequence_axis == "sequence"
  single = AbstractMesh((1, 1, 1, 1), sharding.MESH_AXES)
  with sharding.kernel_context(single, sharding.DEFAULT_RULES)():
    assert kernel_sharding.current().sequence_axis is None

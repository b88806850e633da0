"""One live run per workdir: a second start is refused naming the holder, a killed one is not."""

import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

from tests.training import tiny_lm
from palimpsa_jax.training import batched
from palimpsa_jax.training import trainer
from palimpsa_jax.training import workdir_lock

REPO = pathlib.Path(__file__).parents[2]
# Holds the lock on argv[1] until killed.
_HOLDER = ("import sys, time; from palimpsa_jax.training import workdir_lock; "
           "workdir_lock.WorkdirLock(sys.argv[1]).acquire(); print('locked', flush=True); "
           "time.sleep(600)")


@pytest.fixture(autouse=True)
def _tiny_model(monkeypatch):
  tiny_lm.use_tiny_model(monkeypatch)


def _files(directory: pathlib.Path) -> dict[str, bytes]:
  return {str(p.relative_to(directory)): p.read_bytes()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_second_train_py_is_refused_before_writing_anything(tmp_path):
  workdir = tmp_path / "run"
  with workdir_lock.WorkdirLock(str(workdir)):
    before = _files(workdir)
    result = subprocess.run(
        [sys.executable, "train.py", "--config=configs/mqar.py", f"--workdir={workdir}",
         "--compilation_cache_dir="], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert _files(workdir) == before
  assert result.returncode == 1
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith(
      f"train.py: --workdir {workdir} is in use by a running run: pid {os.getpid()} on host "
      f"{socket.gethostname()} (started ")
  assert line.endswith(f"which holds {workdir}/lock. Wait for it to end or stop it, or give "
                       "another --workdir.")


def test_the_lock_is_held_while_training_and_released_after(tmp_path):
  refusals = []

  def start_another():
    try:
      workdir_lock.WorkdirLock(str(tmp_path)).acquire()
    except workdir_lock.WorkdirLocked as refused:
      refusals.append(str(refused))
    return False

  trainer.train_and_evaluate(tiny_lm.tiny_mqar_config(total_steps=2), str(tmp_path),
                             should_stop=start_another)
  assert len(refusals) == 2 and f"pid {os.getpid()}" in refusals[0]
  assert (tmp_path / "lock").read_text() == ""  # released: no holder named
  with workdir_lock.WorkdirLock(str(tmp_path)):
    pass


def test_a_killed_holder_does_not_block_the_next_start(tmp_path):
  holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(workdir_lock.WorkdirLocked, match=f"pid {holder.pid} on host"):
      trainer.train_and_evaluate(tiny_lm.tiny_mqar_config(total_steps=2), str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["lock"]  # refused before writing anything
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  assert f'"pid": {holder.pid}' in (tmp_path / "lock").read_text()  # left by the killed run
  summary = trainer.train_and_evaluate(tiny_lm.tiny_mqar_config(total_steps=2), str(tmp_path))
  assert summary["final_step"] == 2


def test_a_refused_start_leaves_no_directory_behind(tmp_path):
  workdir = tmp_path / "new" / "run"
  lock = workdir_lock.WorkdirLock(str(workdir)).acquire()
  assert sorted(os.listdir(workdir)) == ["lock"]
  lock.release()
  assert not (tmp_path / "new").exists()


def test_the_sweep_takes_the_lock_of_every_run(tmp_path):
  configs = [tiny_lm.tiny_mqar_config(total_steps=2, **{"optimizer.learning_rate": lr})
             for lr in (1e-2, 3e-3)]
  workdirs = [str(tmp_path / "a"), str(tmp_path / "b")]
  with workdir_lock.WorkdirLock(workdirs[1]):
    with pytest.raises(workdir_lock.WorkdirLocked, match=f"--workdir {workdirs[1]} is in use"):
      batched.train_group(configs, workdirs)
  assert not (tmp_path / "a").exists()  # the first run's lock was released with nothing in it

"""A write into the workdir that fails stops the run in one line; the rerun resumes.

Each failure is injected at the write it breaks (every machine), and made real where this
machine allows it: a folder made read-only (chmod, or a read-only bind mount for root, whom
chmod does not stop) and a full filesystem (a small tmpfs, root only).
"""

import contextlib
import errno
import logging
import os
import pathlib
import subprocess
import time

import pytest

from tests.training import tiny_lm
from palimpsa_jax import user_errors
from palimpsa_jax.training import checkpoint as checkpoint_lib
from palimpsa_jax.training import metrics as metrics_lib
from palimpsa_jax.training import storage
from palimpsa_jax.training import tensorboard
from palimpsa_jax.training import trainer


@pytest.fixture(autouse=True)
def _tiny_model(monkeypatch):
  tiny_lm.use_tiny_model(monkeypatch)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The losses of an uninterrupted 8-step run (checkpoints at steps 4 and 8)."""
  with pytest.MonkeyPatch.context() as patcher:
    tiny_lm.use_tiny_model(patcher)
    workdir = tmp_path_factory.mktemp("uninterrupted")
    trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(8), str(workdir))
  return _losses(workdir)


def _losses(workdir) -> dict[int, float]:
  return {r["step"]: r["train/loss"] for r in metrics_lib.read_metrics(str(workdir))
          if "train/loss" in r}


def _full_disk(path: str) -> str:
  return (f"cannot write {path}: No space left on device [ENOSPC]; the run stopped at step "
          "{step}. Free space on that disk, then rerun the same command to resume from the "
          "last good checkpoint, {last}.")


def _assert_resumes(workdir: pathlib.Path, capsys, uninterrupted, step: int) -> None:
  """The same command again resumes from checkpoints/`step` and ends as an uninterrupted run."""
  capsys.readouterr()
  summary = trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(8), str(workdir))
  assert f"resumed from {workdir}/checkpoints/{step}" in capsys.readouterr().out
  assert summary["final_step"] == 8
  assert _losses(workdir) == uninterrupted


def test_a_checkpoint_that_cannot_be_written_stops_the_run_in_one_line(
    tmp_path, monkeypatch, capsys, uninterrupted):
  save = checkpoint_lib.ocp.CheckpointManager.save

  def full_at_step_eight(manager, step, *args, **kwargs):
    if step == 8:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return save(manager, step, *args, **kwargs)

  monkeypatch.setattr(checkpoint_lib.ocp.CheckpointManager, "save", full_at_step_eight)
  with pytest.raises(storage.StorageError) as stopped:
    trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(8), str(tmp_path))
  assert str(stopped.value) == _full_disk(f"{tmp_path}/checkpoints/8").format(
      step=8, last=f"{tmp_path}/checkpoints/4")
  assert not (tmp_path / "summary.json").exists()
  monkeypatch.setattr(checkpoint_lib.ocp.CheckpointManager, "save", save)
  _assert_resumes(tmp_path, capsys, uninterrupted, 4)


@pytest.mark.parametrize("error, reason", [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "No space left on device [ENOSPC]"),
    (OSError(errno.EROFS, os.strerror(errno.EROFS), "/x/y"), "Read-only file system [EROFS]"),
    (PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/x/y"),
     "Permission denied [EACCES]"),
    # TensorStore's words for an OS error, inside the error Orbax raises from it.
    (ValueError("Error writing \"x\": [os_error_code=30]\nmore"),
     "Read-only file system [EROFS]"),
    (RuntimeError("Timeout waiting for key\nand more"), "RuntimeError: Timeout waiting for key"),
])
def test_a_failed_write_is_one_line_naming_its_path(tmp_path, capsys, error, reason):
  path = str(tmp_path / "out.json")
  with pytest.raises(storage.WriteFailed) as failed:
    with storage.writing(path):
      raise error
  assert str(failed.value) == f"cannot write {path}: {reason}"
  # At an entry point, outside a training run (eval.py's results): one line, and an earlier
  # file stays as it was.
  (tmp_path / "earlier.json").write_text("earlier")
  def fail(*args, **kwargs):
    raise error
  with pytest.MonkeyPatch.context() as patch:
    patch.delenv(user_errors.TRACEBACK_VARIABLE, raising=False)
    patch.setattr(storage.os, "replace", fail)
    with pytest.raises(SystemExit) as exited:
      user_errors.one_line("eval.py", storage.write_whole)(str(tmp_path / "earlier.json"), "new")
  assert exited.value.code == 1
  assert capsys.readouterr().err == f"eval.py: cannot write {tmp_path}/earlier.json: {reason}\n"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.json"]  # as it was
  assert (tmp_path / "earlier.json").read_text() == "earlier"


class _FullFile:
  """A file whose writes fail with ENOSPC once `marker` is written."""

  def __init__(self, file, marker: bytes | str):
    self._file, self._marker = file, marker

  def write(self, data):
    if self._marker in data:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return self._file.write(data)

  def __getattr__(self, name):
    return getattr(self._file, name)


@pytest.mark.parametrize("target", ["metrics.jsonl", "tensorboard"])
def test_a_metric_write_that_fails_stops_the_run_in_one_line(
    tmp_path, monkeypatch, capsys, uninterrupted, target):
  if target == "metrics.jsonl":
    def full_at_step_six(path, mode="r", *args):
      file = open(path, mode, *args)  # pylint: disable=unspecified-encoding
      return _FullFile(file, '"step": 6') if mode == "a" else file
    monkeypatch.setattr(metrics_lib, "open", full_at_step_six, raising=False)
  else:  # a file system remounted read-only (after an error, say)
    scalars = tensorboard.EventFileWriter.scalars
    def read_only_at_step_six(writer, step, values):
      if step == 6:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
      scalars(writer, step, values)
    monkeypatch.setattr(tensorboard.EventFileWriter, "scalars", read_only_at_step_six)
  with pytest.raises(storage.StorageError) as stopped:
    trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(8), str(tmp_path))
  last = f"{tmp_path}/checkpoints/4"
  if target == "metrics.jsonl":
    assert str(stopped.value) == _full_disk(f"{tmp_path}/metrics.jsonl").format(step=6,
                                                                                last=last)
  else:
    (events,) = tensorboard.event_files(str(tmp_path / "tensorboard"))
    assert str(stopped.value) == (
        f"cannot write {events}: Read-only file system [EROFS]; the run stopped at step 6. "
        f"Make the folder writable, then rerun the same command to resume from the last good "
        f"checkpoint, {last}.")
  monkeypatch.undo()
  tiny_lm.use_tiny_model(monkeypatch)
  _assert_resumes(tmp_path, capsys, uninterrupted, 4)


@contextlib.contextmanager
def _read_only(path: pathlib.Path):
  """Within: `path` cannot be written (skips the test where this machine cannot do that)."""
  if os.geteuid() != 0:
    path.chmod(0o555)
    try:
      yield
    finally:
      path.chmod(0o755)
    return
  mount = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True,
                         check=False)
  if mount.returncode:
    pytest.skip(f"cannot make {path} read-only here: {mount.stderr.decode().strip()}")
  try:
    subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True)
    yield
  finally:
    subprocess.run(["umount", str(path)], check=True)


def _after_step(step: int, checkpoints: pathlib.Path, action):
  """A should_stop that runs `action` after `step`, once a checkpoint in `checkpoints` is
  complete (they are written in the background), and never asks to stop."""
  polls = []
  def poll():
    polls.append(None)
    if len(polls) == step + 1:  # the poll before step `step` + 1
      deadline = time.monotonic() + 60
      while storage.latest_checkpoint(str(checkpoints)) is None:
        assert time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.05)
      action()
    return False
  return poll


def test_a_checkpoint_folder_made_read_only_mid_run_stops_at_once(
    tmp_path, capsys, caplog, uninterrupted):
  workdir = tmp_path / "run"
  checkpoints = workdir / "checkpoints"
  config = tiny_lm.resumable_mqar_config(8, async_checkpointing=True)
  with contextlib.ExitStack() as stack:
    started = time.monotonic()
    with pytest.raises(storage.StorageError) as stopped:
      trainer.train_and_evaluate(config, str(workdir), should_stop=_after_step(
          6, checkpoints, lambda: stack.enter_context(_read_only(checkpoints))))
    assert time.monotonic() - started < 120  # no wait for a timeout
  reason = ("Read-only file system [EROFS]" if os.geteuid() == 0
            else "Permission denied [EACCES]")
  assert str(stopped.value) == (
      f"cannot write {checkpoints}/8: {reason}; the run stopped at step 8. Make the folder "
      f"writable, then rerun the same command to resume from the last good checkpoint, "
      f"{checkpoints}/4.")
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
  _assert_resumes(workdir, capsys, uninterrupted, 4)


def test_a_full_disk_stops_the_run_in_one_line(tmp_path, capsys, caplog, uninterrupted):
  if os.geteuid() != 0:
    pytest.skip("mounting a small filesystem needs root")
  workdir = tmp_path / "run"
  workdir.mkdir()
  mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(workdir)],
                         capture_output=True, check=False)
  if mount.returncode:
    pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.decode().strip()}")
  filler = workdir / "filler"

  def fill():
    free = os.statvfs(workdir)
    with open(filler, "wb") as f:
      f.write(b"\0" * (free.f_bavail * free.f_frsize))

  try:
    config = tiny_lm.resumable_mqar_config(8, async_checkpointing=True)
    with pytest.raises(storage.StorageError) as stopped:
      trainer.train_and_evaluate(config, str(workdir), should_stop=_after_step(
          6, workdir / "checkpoints", fill))
    message = str(stopped.value)
    assert message.startswith(f"cannot write {workdir}/"), message
    assert message.endswith(
        "No space left on device [ENOSPC]; the run stopped at step 8. Free space on that "
        "disk, then rerun the same command to resume from the last good checkpoint, "
        f"{workdir}/checkpoints/4."), message
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    filler.unlink()
    _assert_resumes(workdir, capsys, uninterrupted, 4)
  finally:
    subprocess.run(["umount", str(workdir)], check=True)

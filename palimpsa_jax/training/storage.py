"""A workdir write that fails (full disk, a folder made read-only) stops the run in one line.

Every write of a run into its workdir (the lock, config.json, checkpoints, metrics.jsonl,
TensorBoard events, segments.jsonl, summary.json) runs inside `writing(path)`, which turns
whatever the write raised into WriteFailed(path, reason, errno). The training loop
(training/loop.py) stops at the first one and raises StorageError, one line naming the path,
the step reached and the last good checkpoint, from which a rerun of the same command resumes.
Outside a run (eval.py's results and plot, through `writing` and `write_whole`), WriteFailed is
itself the one line the entry point prints.

Orbax logs the failures of its background threads with their tracebacks before they reach
the loop; `quiet_orbax_errors` keeps those records off the terminal (--verbose or
PALIMPSA_TRACEBACK=1 shows them), since the loop's line says what failed.
"""

from collections.abc import Callable, Iterator, Mapping
import contextlib
import errno
import gc
import logging
import os
import re
import sys
import threading
import time

from palimpsa_jax import user_errors

# The longest wait for Orbax's threads of a failed save to end.
_ORBAX_THREADS_WAIT_S = 10.0
# The errno a TensorStore write error carries in its text.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


class WriteFailed(user_errors.UserError):
  """A write failed: `path` is what was written, `reason` why (a few words), `code` the errno
  when one is known. Its message is one line; a command that writes outside a training run
  (eval.py's results) lets it reach the entry point, which prints that line."""

  def __init__(self, path: str, reason: str, code: int | None = None):
    super().__init__(f"cannot write {path}: {reason}")
    self.path, self.reason, self.code = path, reason, code


class StorageError(RuntimeError, user_errors.UserError):
  """The run stopped because its workdir could not be written (see the module docstring)."""


def _errno(error: BaseException) -> int | None:
  """The errno of `error` or of its causes: an OSError's, or one in a TensorStore message."""
  while error is not None:
    if isinstance(error, OSError) and error.errno is not None:
      return error.errno
    if match := _OS_ERROR_CODE.search(str(error)):
      return int(match.group(1))
    error = error.__cause__ or error.__context__
  return None


def failure(path: str, error: BaseException) -> WriteFailed:
  """WriteFailed for `error` raised writing `path`: the OS's words for its errno where one is
  known, else the first line of its innermost cause."""
  code = _errno(error)
  if code is not None:
    return WriteFailed(path, f"{os.strerror(code)} [{errno.errorcode.get(code, code)}]", code)
  while error.__cause__ or error.__context__:
    error = error.__cause__ or error.__context__
  lines = str(error).strip().splitlines()
  return WriteFailed(path, f"{type(error).__name__}: {lines[0][:200]}" if lines
                     else type(error).__name__)


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
  """Within: any exception a write raises becomes WriteFailed(path, reason)."""
  try:
    yield
  except WriteFailed:
    raise
  except Exception as error:  # pylint: disable=broad-exception-caught
    raise failure(path, error) from error


def write_whole(path: str, text: str) -> None:
  """Writes `text` into `path` whole or not at all (an earlier file stays as it was when the
  write fails); raises WriteFailed naming `path`."""
  partial = path + ".partial"
  with writing(path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
      with open(partial, "w") as f:
        f.write(text)
      os.replace(partial, path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.remove(partial)
      raise


def latest_checkpoint(checkpoint_dir: str) -> str | None:
  """The newest complete checkpoint folder (<dir>/<step>) in `checkpoint_dir`, or None.

  Orbax writes a step into a temporary folder and renames it to the step's number once it
  is complete, so a numbered folder is a whole checkpoint.
  """
  try:
    steps = [int(name) for name in os.listdir(checkpoint_dir) if name.isdigit()]
  except OSError:
    return None
  return os.path.join(checkpoint_dir, str(max(steps))) if steps else None


def stopped(failed: WriteFailed, step: int | None, checkpoint_dir: str) -> StorageError:
  """The one-line StorageError for `failed` at `step` (None: before the first step)."""
  if failed.code in (errno.ENOSPC, errno.EDQUOT):
    fix = "Free space on that disk, then rerun"
  elif failed.code in (errno.EROFS, errno.EACCES, errno.EPERM):
    fix = "Make the folder writable, then rerun"
  else:
    fix = "Once it can be written, rerun"
  where = "before the first step" if step is None else f"at step {step}"
  last = latest_checkpoint(checkpoint_dir)
  then = (f"to resume from the last good checkpoint, {last}" if last
          else "to start the run again (it had no checkpoint yet)")
  return StorageError(f"cannot write {failed.path}: {failed.reason}; the run stopped {where}. "
                      f"{fix} the same command {then}.")


@contextlib.contextmanager
def stop_on_failed_write(checkpoint_dirs: Mapping[str, str],
                         step: Callable[[], int | None] = lambda: None) -> Iterator[None]:
  """Within: a WriteFailed becomes the one-line StorageError (`stopped`).

  Args:
    checkpoint_dirs: {workdir: its checkpoint folder} of the runs whose files are written;
      the failed path's workdir names its last good checkpoint.
    step: the step reached (None: before the first step).
  """
  try:
    yield
  except WriteFailed as failed:
    workdir = next((w for w in checkpoint_dirs
                    if failed.path == w or failed.path.startswith(w + os.sep)),
                   next(iter(checkpoint_dirs)))
    raise stopped(failed, step(), checkpoint_dirs[workdir]) from failed


class _DropOrbaxErrors(logging.Filter):
  """Drops Orbax's error records, and asyncio's about the futures of its failed writes."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR:
      return True
    return not (record.name == "asyncio" or f"{os.sep}orbax{os.sep}" in record.pathname)


@contextlib.contextmanager
def quiet_orbax_errors() -> Iterator[None]:
  """Within: the error records that Orbax's background threads log (with their tracebacks)
  for a failed write, and asyncio's for the futures those writes leave behind, are not shown
  (the loop's line says what failed), unless tracebacks are wanted
  (user_errors.wants_traceback). The project itself logs no errors through asyncio."""
  if user_errors.wants_traceback(sys.argv):
    yield
    return
  loggers, dropping = [logging.getLogger(n) for n in ("absl", "asyncio")], _DropOrbaxErrors()
  for logger in loggers:
    logger.addFilter(dropping)
  try:
    yield
  except BaseException:
    # After a failed save, the threads of its other writes may still be failing (and
    # logging): they end within moments, as every write fails.
    deadline = time.monotonic() + _ORBAX_THREADS_WAIT_S
    for thread in threading.enumerate():
      if type(thread).__module__.startswith("orbax."):
        # threading's join: Orbax's own raises the thread's error once more.
        threading.Thread.join(thread, max(deadline - time.monotonic(), 0))
    gc.collect()  # the failed writes' futures report themselves when they are collected
    raise
  finally:
    for logger in loggers:
      logger.removeFilter(dropping)

"""One live run per workdir: an OS lock on <workdir>/lock, held for the run's lifetime.

The lock is `fcntl.flock` on the file: the kernel releases it when the holding process ends,
however it ends (SIGKILL, a crash, power loss), so a lock left by a killed run never blocks
the next start and no stale-lock cleanup is needed. The holder writes its pid, host and start
time into the file, only to name itself to a refused second start. A run that was accepted
(`accept`) empties the file when it releases the lock; a start that was refused puts back what
the file held before (or removes the file it created), so that it leaves the workdir as it was. On NFSv4 the kernel forwards flock to the server, so a run on another host
sharing the filesystem is refused as well; a filesystem without locks (some FUSE mounts) gets a
warning and no lock.

In a multi-host run only process 0 takes the lock (it writes the run's files; all processes
share the workdir) and tells the others whether to go on, so they refuse together.
"""

import datetime
import errno
import fcntl
import json
import os
import socket
import warnings

import jax
from jax.experimental import multihost_utils
import numpy as np

from palimpsa_jax import user_errors
from palimpsa_jax.training import storage

LOCK_FILE = "lock"
# flock errors meaning "this filesystem has no locks", not "someone holds it".
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class WorkdirLocked(RuntimeError, user_errors.UserError):
  """Another live run holds the workdir."""


def _holder_text(path: str) -> str:
  """"pid 123 on host h (started 2026-...Z)" from the lock file, or what is known of it."""
  try:
    with open(path) as f:
      holder = json.loads(f.read() or "{}")
  except (OSError, json.JSONDecodeError):
    holder = {}
  if not holder:  # it has not written its name yet
    return "another process"
  return (f"pid {holder.get('pid')} on host {holder.get('host')} "
          f"(started {holder.get('started')})")


class WorkdirLock:
  """Holds <workdir>/lock from `acquire()` to `release()` (also a context manager).

  A start refused after taking the lock leaves the workdir as it was: the lock file holds what
  it held before, or, made by acquire(), is removed with the directories acquire() made. An
  accepted run (`accept`) leaves it empty, or removes it where the workdir holds nothing else.
  """

  def __init__(self, workdir: str):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, LOCK_FILE)
    self._fd: int | None = None
    self._created: list[str] = []  # directories made here, innermost first
    self._previous: bytes | None = None  # the file's bytes before acquire(); None: made there
    self._accepted = False

  def acquire(self) -> "WorkdirLock":
    """Takes the lock (process 0), or raises WorkdirLocked naming the holder on every process."""
    refusal = self._acquire_here() if jax.process_index() == 0 else None
    if jax.process_count() > 1:
      refused = multihost_utils.broadcast_one_to_all(np.int32(refusal is not None))
      if refused and refusal is None:
        refusal = f"--workdir {self.workdir} is in use by another run (process 0 was refused)"
    if refusal is not None:
      self.release()
      raise WorkdirLocked(refusal)
    return self

  def _acquire_here(self) -> str | None:
    """Takes the lock; None, or the refusal message if another process holds it."""
    self._make_dirs()
    while True:
      try:
        fd, made = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
      except FileExistsError:
        try:
          fd, made = os.open(self.path, os.O_RDWR), False
        except FileNotFoundError:  # removed by a releasing holder meanwhile
          continue
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as error:
        os.close(fd)
        if error.errno in _NO_LOCKS:
          warnings.warn(f"{self.path}: this filesystem cannot lock files ({error.strerror}); "
                        "a second run on this workdir will not be refused.",
                        RuntimeWarning, stacklevel=3)
          return None
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
          raise
        return (f"--workdir {self.workdir} is in use by a running run: "
                f"{_holder_text(self.path)}, which holds {self.path}. Wait for it to end "
                "or stop it, or give another --workdir.")
      # A releasing holder may have removed the file between our open and flock: then the
      # lock is on a file no other process can open; lock the one at the path instead.
      try:
        if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
          break
      except FileNotFoundError:
        pass
      os.close(fd)
    self._fd = fd
    self._previous = None if made else os.pread(fd, os.fstat(fd).st_size, 0)
    holder = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds")}
    try:
      with storage.writing(self.path):
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
    except storage.WriteFailed:
      self.release()
      raise
    return None

  def accept(self) -> None:
    """Notes that the run was accepted: release() then empties the file instead of putting
    back what it held before (a killed run's name)."""
    self._accepted = True

  def _make_dirs(self) -> None:
    missing, path = [], self.workdir
    while not os.path.isdir(path):
      missing.append(path)
      path = os.path.dirname(path)
    for path in reversed(missing):
      try:
        os.mkdir(path)
        self._created.insert(0, path)
      except FileExistsError:  # made by another process meanwhile
        pass

  def release(self) -> None:
    """Releases the lock, leaving the file as the class docstring says."""
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      alone = os.listdir(self.workdir) == [LOCK_FILE]
      if (self._previous is None and not self._accepted) or (self._accepted and alone):
        os.unlink(self.path)  # before the unlock: see the st_ino check in _acquire_here
        for path in self._created:
          try:
            os.rmdir(path)
          except OSError:  # not empty: another process wrote there meanwhile
            break
      else:
        os.ftruncate(fd, 0)
        if not self._accepted:
          os.pwrite(fd, self._previous, 0)
    except OSError:  # a folder made read-only: the holder's name stays, the lock goes
      pass
    finally:
      os.close(fd)  # releases the flock

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc_info) -> None:
    self.release()

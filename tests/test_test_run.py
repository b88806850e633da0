"""The test run itself: it ends with its results, nothing printed after them."""

import os
import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).parents[1]

# A test that leaves garbage whose finaliser is slow (as JAX's collection of XLA buffers and
# grain's thread pools can be on a busy machine): a reference cycle that only a full garbage
# collection frees (the automatic ones are off, as they would rarely reach an old object).
_SLOW_FINALISER = '''
import gc
import time

class Slow:
  def __del__(self):
    time.sleep(7)

def test_leaves_slow_garbage():
  gc.disable()
  slow = Slow()
  slow.cycle = slow
'''


def test_a_worker_is_not_interrupted_after_its_tests(tmp_path):
  """xdist asks each worker to exit once all have reported and sends SIGINT to one that is
  still busy 5 s later; its last garbage collection must not be what keeps it busy."""
  shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
  (tmp_path / "test_slow.py").write_text(_SLOW_FINALISER)
  done = subprocess.run(
      [sys.executable, "-m", "pytest", "-n", "1", "-q", "-s", "-p", "no:cacheprovider",
       str(tmp_path)],
      cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
      env={**os.environ, "PYTHONPATH": str(REPO)})
  output = done.stdout + done.stderr
  assert done.returncode == 0 and "1 passed" in output, output
  assert "KeyboardInterrupt" not in output and "Exception ignored" not in output, output

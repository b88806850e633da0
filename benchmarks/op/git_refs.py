"""The project's packages (palimpsa_jax, pallas_kernels) as they are at a git ref, importable
in turn in one process: bench.py --refs times one ref's op after another's.

    with packages_from(export("HEAD~1", tmp)):
      palimpsa = importlib.import_module("palimpsa_jax.ops").palimpsa   # HEAD~1's op
"""

import contextlib
import io
import pathlib
import subprocess
import sys
import tarfile

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("palimpsa_jax", "pallas_kernels")


def describe(ref: str) -> str:
  """The commit a ref names, or for '.' the working tree's HEAD and whether it has changes."""
  git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], check=True,
                                  capture_output=True, text=True).stdout.strip()
  if ref == ".":
    changed = git("status", "--porcelain", "--", *PACKAGES)
    return f"working tree ({git('rev-parse', '--short', 'HEAD')}{' + changes' if changed else ''})"
  try:
    return git("rev-parse", "--short", f"{ref}^{{commit}}")
  except subprocess.CalledProcessError as e:
    raise ValueError(f"--refs: {ref!r} is not a commit of {REPO}") from e


def export(ref: str, dest: pathlib.Path) -> pathlib.Path:
  """A directory holding the ref's packages: the repository for '.', else a git archive."""
  if ref == ".":
    return REPO
  archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref, *PACKAGES],
                           check=True, capture_output=True).stdout
  with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
    tar.extractall(dest, filter="data")
  return dest


@contextlib.contextmanager
def packages_from(root: pathlib.Path):
  """Inside the block, palimpsa_jax and pallas_kernels import from root; the modules
  imported before it are put back after it (a function built inside keeps working)."""
  saved = {n: m for n, m in sys.modules.items() if n.split(".")[0] in PACKAGES}
  for name in saved:
    del sys.modules[name]
  sys.path.insert(0, str(root))
  try:
    yield
  finally:
    sys.path.remove(str(root))
    for name in [n for n in sys.modules if n.split(".")[0] in PACKAGES]:
      del sys.modules[name]
    sys.modules.update(saved)

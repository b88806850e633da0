"""No test imports a test module.

A test module is a file pytest collects (test_*.py) or a conftest.py. Importing one from another
file ties the two together (removing or renaming one breaks the other) and can make pytest run
the imported tests twice. What tests share lives in helper modules under tests/ whose names do
not start with test_ (e.g. tests/ops/numerics.py, tests/ops/palimpsa/palimpsa_suite.py,
tests/training/tiny_lm.py) or in conftest fixtures, which pytest hands to tests by name.
"""

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"


def _is_test_module(module: str) -> bool:
  name = module.rpartition(".")[2]
  return name.startswith("test_") or name == "conftest"


def _imported_modules(path: pathlib.Path, text: str) -> list[tuple[str, int]]:
  """(dotted module, line) of every module an import in `text` (the file at `path`) may name:
  `from a import b` gives a.b as well as a, since b may be a module."""
  package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
  found = []
  for node in ast.walk(ast.parse(text, str(path))):
    if isinstance(node, ast.Import):
      found += [(alias.name, node.lineno) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        anchor = parts[:len(parts) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      found.append((base, node.lineno))
      found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
  return found


def _test_module_imports(path: pathlib.Path, text: str) -> list[str]:
  return [f"line {line}: {module}" for module, line in _imported_modules(path, text)
          if module.startswith("tests.") and _is_test_module(module)]


def test_no_test_imports_a_test_module():
  found = []
  for path in sorted(TESTS.rglob("*.py")):
    found += [f"{path.relative_to(REPO)}: {hit}" for hit in _test_module_imports(path, path.read_text())]
  assert not found, ("test files that import a test module (move what they share into a "
                     "helper module or a conftest fixture):\n" + "\n".join(found))


@pytest.mark.parametrize("source, hits", [
    ("from tests.models.test_x import helper\n", ["line 1: tests.models.test_x"]),
    ("from tests.models import test_x\n", ["line 1: tests.models.test_x"]),
    ("from .test_x import helper\n", ["line 1: tests.ops.test_x"]),
    ("from . import conftest\n", ["line 1: tests.ops.conftest"]),
    ("import tests.ops.test_x as t\n", ["line 1: tests.ops.test_x"]),
    ("from tests.ops import numerics\nfrom jax.test_util import check_grads\n", []),
])
def test_the_reader_finds_test_module_imports(source, hits):
  """Absolute, relative, `from package import module` and aliased imports are all seen; helper
  modules and other packages' test_ modules are not flagged."""
  assert _test_module_imports(TESTS / "ops" / "test_here.py", source) == hits

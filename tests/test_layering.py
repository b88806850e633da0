"""The package's floors: every import, top-level or inside a function, points down or sideways.

  entry points (train.py, eval.py, generate.py, the conversion command)
  evaluation, conversion
  training
  models
  layers
  ops
  pallas_kernels (the kernels)
  data, run_config, user_errors (the ground: they import neither each other's floors nor any
  above, except user_errors, the base of every floor's refusals)

Floors are whole subpackages of palimpsa_jax (plus the top-level pallas_kernels package), so
modules may move inside one without touching this test. Subpackages on one floor may import
each other as long as no cycle forms. Imports inside functions count like any other; the few
that stay deferred (a heavy optional dependency, on purpose) say why in a "# Deferred:"
comment just above.
"""

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("palimpsa_jax", "pallas_kernels")
# Higher numbers are higher floors.
FLOORS = {
    "data": 0,
    "run_config": 0,
    "user_errors": 0,
    "pallas_kernels": 1,
    "ops": 2,
    "layers": 3,
    "models": 4,
    "training": 5,
    "evaluation": 6,
    "conversion": 6,
}
# Imports inside functions, each one commented at its place.
MOST_DEFERRED_IMPORTS = 5


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(REPO).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _files() -> list[pathlib.Path]:
  return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def _subpackage(module: str) -> str | None:
  """The floor a dotted module name belongs to; None outside the project."""
  parts = module.split(".")
  if parts[0] == "pallas_kernels":
    return "pallas_kernels"
  if parts[0] == "palimpsa_jax":
    return parts[1] if len(parts) > 1 else "palimpsa_jax"
  return None


def _package(path: pathlib.Path) -> str:
  """The package a relative import in the file at `path` starts from."""
  module = _module_name(path)
  return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _absolute_base(node: ast.ImportFrom, package: str) -> str:
  """The module a `from ... import` statement in `package` imports from."""
  base = node.module or ""
  if node.level:
    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
    base = ".".join(anchor + ([base] if base else []))
  return base


def _imports(path: pathlib.Path, text: str) -> list[tuple[str, int, bool]]:
  """(imported module, line, inside a function) of every import in `text`, the file at `path`."""
  package = _package(path)
  found = []

  def visit(node: ast.AST, in_function: bool) -> None:
    for child in ast.iter_child_nodes(node):
      nested = in_function or isinstance(
          child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, ast.Import):
        found.extend((alias.name, child.lineno, in_function) for alias in child.names)
      elif isinstance(child, ast.ImportFrom):
        base = _absolute_base(child, package)
        # `from palimpsa_jax import models` names the subpackage itself.
        names = [f"{base}.{a.name}" for a in child.names] if base in PACKAGES else [base]
        found.extend((name, child.lineno, in_function) for name in names)
      visit(child, nested)

  visit(ast.parse(text, str(path)), False)
  return found


def _edges() -> dict[tuple[str, str], list[str]]:
  """(importing subpackage, imported subpackage) -> "file:line" of each such import."""
  edges: dict[tuple[str, str], list[str]] = {}
  for path in _files():
    source = _subpackage(_module_name(path))
    for name, line, _ in _imports(path, path.read_text()):
      target = _subpackage(name)
      if target is not None and target != source:
        edges.setdefault((source, target), []).append(
            f"{path.relative_to(REPO)}:{line}")
  return edges


def test_every_subpackage_has_a_floor():
  found = {_subpackage(_module_name(p)) for p in _files()} - {"palimpsa_jax"}
  missing = sorted(found - set(FLOORS))
  assert not missing, (f"subpackages {missing} have no floor in FLOORS; place them "
                       "(and their imports) in the layering")


def test_no_import_goes_up_a_floor():
  upward = [f"{where}: {source} imports {target}"
            for (source, target), places in _edges().items()
            if source in FLOORS and target in FLOORS and FLOORS[target] > FLOORS[source]
            for where in places]
  assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(upward)


def test_no_cycle_between_subpackages():
  graph: dict[str, set[str]] = {}
  for source, target in _edges():
    graph.setdefault(source, set()).add(target)

  def reaches(start: str, goal: str, seen: set[str]) -> bool:
    for nxt in graph.get(start, ()):
      if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
        return True
    return False

  cycles = sorted(f"{a} <-> {b}" for a, b in _edges() if reaches(b, a, {b}))
  assert not cycles, "subpackages that import each other (directly or not): " + ", ".join(
      cycles)


def test_deferred_imports_are_few_and_say_why():
  deferred = []
  for path in _files():
    text = path.read_text()
    lines = text.splitlines()
    for name, line, in_function in _imports(path, text):
      if in_function:
        deferred.append(f"{path.relative_to(REPO)}:{line}: {name}")
        above = [l.strip() for l in lines[max(0, line - 4):line - 1]]
        assert any(l.startswith("# Deferred:") for l in above), (
            f"{path.relative_to(REPO)}:{line}: import {name} inside a function: import it at "
            "the top (a cycle means something belongs on a lower floor), or say why it is "
            "deferred in a '# Deferred: <why>' comment just above it")
  # matplotlib and matplotlib.pyplot, imported for one plot, count once.
  count = sum(not d.endswith(": matplotlib.pyplot") for d in deferred)
  assert count <= MOST_DEFERRED_IMPORTS, "\n".join(deferred)


def _names_taken(path: pathlib.Path, text: str) -> list[tuple[str, int]]:
  """(dotted name, line) of everything an import in `text` binds: `from a.b import c` takes
  a.b.c, `import a.b` takes a.b."""
  package = _package(path)
  taken = []
  for node in ast.walk(ast.parse(text, str(path))):
    if isinstance(node, ast.Import):
      taken.extend((alias.name, node.lineno) for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = _absolute_base(node, package)
      taken.extend((f"{base}.{alias.name}", node.lineno) for alias in node.names)
  return taken


def test_no_op_imports_another_ops_api():
  """The ops are siblings: an op package (palimpsa_jax/ops/NAME/) takes from another only its
  implementations table (to run it through ops.dispatch, as palimpsa's beta=None path runs
  SimpleGLA's); what two ops share lives in a module of palimpsa_jax/ops/ below both."""
  ops = REPO / "palimpsa_jax" / "ops"
  packages = {p.name for p in ops.iterdir() if (p / "__init__.py").exists()}
  found = []
  for path in sorted(ops.glob("*/*.py")):
    for name, line in _names_taken(path, path.read_text()):
      parts = name.split(".")
      if (parts[:2] == ["palimpsa_jax", "ops"] and len(parts) > 2 and parts[2] in packages
          and parts[2] != path.parent.name and parts[3:4] != ["implementations"]):
        found.append(f"{path.relative_to(REPO)}:{line}: {name}")
  assert not found, "an op importing another op's api, types or helpers:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("def f():\n  from palimpsa_jax.training import trainer\n",
     [("palimpsa_jax.training", 2, True)]),
    ("from palimpsa_jax import models, data\n",
     [("palimpsa_jax.models", 1, False), ("palimpsa_jax.data", 1, False)]),
    ("from . import op\n", [("pallas_kernels.palimpsa_gpu", 1, False)]),
])
def test_imports_are_read_with_their_targets(source, expected):
  """The reader these tests rely on sees nested, package-level and relative imports."""
  path = REPO / "pallas_kernels" / "palimpsa_gpu" / "op.py"
  assert _imports(path, source) == expected

"""A mixer's name is spelled in palimpsa_jax/models/registry.py and nowhere else in the product.

The other files read names, defaults, labels and colours from the registry, so a new mixer
is a registry entry and its layer. The conversions to outside formats (the authors' PyTorch
models, Hugging Face Mamba2) map those formats' names to ours and may spell ours. Docstrings
and comments are prose and may name mixers; every other string literal may not, as a whole
or as a word of it ("model=palimpsa_d", "mamba2,palimpsa_d").
"""

import ast
import pathlib
import re

from palimpsa_jax.models import registry

REPO = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = ("palimpsa_jax", "pallas_kernels", "benchmarks", "configs")
ENTRY_POINTS = ("train.py", "eval.py", "generate.py")
ALLOWED = ("palimpsa_jax/models/registry.py",
           "palimpsa_jax/conversion/torch_layouts.py",  # the authors' model types
           "palimpsa_jax/conversion/hf_mamba2.py")  # Hugging Face's Mamba2
# Every mixer and kind name; "attention" is a kind but also an ordinary word (layer names,
# attention_implementation), so a literal naming the kind is not told from one that does not.
NAMES = (set(registry.MIXERS) | set(registry.KINDS)) - {"attention"}


def _product_files() -> list[pathlib.Path]:
  files = [REPO / name for name in ENTRY_POINTS]
  files += [p for folder in PRODUCT for p in sorted((REPO / folder).rglob("*.py"))]
  return [p for p in files if str(p.relative_to(REPO)) not in ALLOWED]


def _docstrings(tree: ast.AST) -> set[int]:
  """ids of the docstring nodes of the module, its classes and functions."""
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
          and isinstance(body[0].value.value, str)):
        found.add(id(body[0].value))
  return found


def spelled_names(source: str) -> list[tuple[int, str]]:
  """(line, name) of every mixer name in a non-docstring string literal of `source`."""
  tree = ast.parse(source)
  docstrings = _docstrings(tree)
  found = []
  for node in ast.walk(tree):
    if (isinstance(node, ast.Constant) and isinstance(node.value, str)
        and id(node) not in docstrings):
      found += [(node.lineno, word) for word in re.findall(r"\w+", node.value)
                if word in NAMES]
  return found


def test_the_check_finds_a_spelled_name():
  assert spelled_names('"""palimpsa_d in a docstring."""\nx = "mamba2,palimpsa_d"\n') == [
      (2, "mamba2"), (2, "palimpsa_d")]
  assert spelled_names('f(model="transformer")  # not "mesanet"\n') == [(1, "transformer")]
  assert not spelled_names('key = "x_mamba2"\nname = registry.DEFAULT\n')


def test_mixer_names_are_spelled_only_in_the_registry():
  spelled = [f"{path.relative_to(REPO)}:{line}: {name!r}"
             for path in _product_files()
             for line, name in spelled_names(path.read_text())]
  assert not spelled, ("mixer names spelled outside the registry (read them from "
                       "palimpsa_jax/models/registry.py):\n" + "\n".join(spelled))

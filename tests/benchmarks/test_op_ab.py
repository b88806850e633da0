"""benchmarks/op_ab.py on CPU: refs imported in turn, a timed comparison, argument checks."""

import math
import sys

import pytest

from benchmarks import op_ab

pytestmark = pytest.mark.skipif(not (op_ab.REPO / ".git").exists(),
                                reason="needs the git checkout")


def test_a_ref_imports_from_its_export_and_the_modules_come_back(tmp_path):
  before = sys.modules.get("palimpsa_jax.ops")
  root = op_ab.export("HEAD", tmp_path)
  with op_ab.packages_from(root):
    import palimpsa_jax.ops  # pylint: disable=import-outside-toplevel
    assert palimpsa_jax.ops.__file__.startswith(str(tmp_path))
    assert callable(palimpsa_jax.ops.palimpsa)
  assert sys.modules.get("palimpsa_jax.ops") is before
  assert str(root) not in sys.path


def test_compares_two_refs_in_one_process():
  rows = op_ab.main(["--refs", "HEAD", ".", "--shapes", "small", "--only", "tiny",
                     "--impl", "chunked", "--modes", "fwd", "fwd+bwd", "--rounds", "2",
                     "--warmup", "1", "--iters", "2", "--rotate", "1", "--no_record"])
  assert [(r["mode"], r["ref"]) for r in rows] == [
      ("fwd", "HEAD"), ("fwd", "."), ("fwd+bwd", "HEAD"), ("fwd+bwd", ".")]
  for r in rows:
    assert len(r["ms"]) == 2 and all(t > 0 for t in r["ms"])
    assert r["median_ms"] > 0 and math.isfinite(r["max_rel_difference"])
    assert r["first_call_s"] > 0
  first = [r for r in rows if r["ref"] == "HEAD"]
  assert all(r["speed_up"] == 1.0 and r["max_rel_difference"] == 0.0 for r in first)
  assert rows[1]["commit"].startswith("working tree (")
  table = op_ab.format_table(rows)
  assert table.count("\n") == len(rows) + 1 and "| tiny |" in table


def test_an_unknown_ref_is_named():
  with pytest.raises(ValueError, match="--refs"):
    op_ab.describe("no-such-ref-anywhere")


@pytest.mark.parametrize("argv", [["--refs", "HEAD"], ["--refs", "HEAD", ".", "--only", "D999"],
                                  ["--refs", "HEAD", ".", "--modes", "bwd"],
                                  ["--refs", "HEAD", ".", "--rounds", "0"]])
def test_bad_arguments_exit(argv):
  with pytest.raises(SystemExit):
    op_ab.parse_args(argv)

"""The persistent compilation cache: a second start compiles the train step >= 2x faster."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from palimpsa_jax.training import compile_cache

REPO = pathlib.Path(__file__).parents[2]

# One fresh process: the tiny trainer model for 2 steps; prints the summary.
_RUN = """
import json
import pytest
from palimpsa_jax.training import compile_cache, trainer
from tests.training import tiny_lm
compile_cache.configure({cache!r})
with pytest.MonkeyPatch.context() as patcher:
  tiny_lm.use_tiny_model(patcher)
  summary = trainer.train_and_evaluate(
      tiny_lm.tiny_mqar_config(total_steps=2, log_every_steps=1), {workdir!r})
print("SUMMARY", json.dumps(summary))
"""


def _start(tmp_path, name: str, cache: str) -> dict:
  code = _RUN.format(cache=cache, workdir=str(tmp_path / name))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, check=True, timeout=300).stdout
  line = next(l for l in out.splitlines() if l.startswith("SUMMARY "))
  first = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
  return {**json.loads(line[len("SUMMARY "):]), "first_record": first}


def _files(directory: pathlib.Path) -> int:
  return sum(len(files) for _, _, files in os.walk(directory))


def test_second_start_reads_the_cache_and_compiles_twice_as_fast(tmp_path):
  cache = tmp_path / "cache"
  cold = _start(tmp_path, "cold", str(cache))
  entries = _files(cache)
  warm = _start(tmp_path, "warm", str(cache))
  assert entries > 0 and cold["first_record"]["perf/compile_cache_hits"] == 0
  assert warm["first_record"]["perf/compile_cache_hits"] >= 1
  assert 2 * warm["compile_s"] <= cold["compile_s"], (cold["compile_s"], warm["compile_s"])
  assert warm["time_to_first_step_s"] >= warm["compile_s"] > 0


def test_configure_sets_and_clears_the_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache.default_cache_dir() == str(tmp_path / "xdg" / "palimpsa_jax" / "jax_cache")
  monkeypatch.setenv("HOME", str(tmp_path))
  directory = compile_cache.configure("~/c")
  assert directory == str(tmp_path / "c")
  assert os.path.isdir(directory) and jax.config.jax_compilation_cache_dir == directory
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
  assert compile_cache.configure("") is None and not jax.config.jax_enable_compilation_cache
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match="--compilation_cache_dir="):
    compile_cache.configure(str(tmp_path / "file" / "cache"))

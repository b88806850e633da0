"""Fast Palimpsa against the authors' own PyTorch definition, on the same inputs.

Their file is not part of this project: the test loads it from the path in
FAST_PALIMPSA_AUTHORS_FILE (their `Palimpsa/palimpsa/ops/fast_palimpsa/
chunk_fast_palimpsa_v2.py`) and runs it, through authors_torch_runner.py, under the Python in
FAST_PALIMPSA_TORCH_PYTHON (default: this one), which needs torch and numpy. It skips when
either is missing. docs/fast_palimpsa.md gives the command.

Conventions mapped: their decay exp(-dt * A) is our exp(log_alpha), so log_alpha = -dt * A and
d/d dt = -A d/d log_alpha; their q is scaled inside, ours arrives scaled (they get scale=1);
their beta `b` is ours; their Ip [H] is our prior_precision. Their forms take T a multiple of
the chunk, start from the prior and have no segments.
"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from palimpsa_jax.ops import fast_palimpsa
from palimpsa_jax.ops.palimpsa import reference_palimpsa
from palimpsa_jax.ops.fast_palimpsa import reference_fast_palimpsa
from tests.ops.numerics import FLOAT32_TOL, GRAD_TOL, assert_close_to_reference

AUTHORS_FILE = os.environ.get("FAST_PALIMPSA_AUTHORS_FILE", "")
TORCH_PYTHON = os.environ.get("FAST_PALIMPSA_TORCH_PYTHON", sys.executable)
RUNNER = pathlib.Path(__file__).with_name("authors_torch_runner.py")
CHUNKS = (16, 32)
SHAPE = (2, 64, 2, 8, 12)  # B, T, H, K, V


def _torch_available() -> bool:
  try:
    return subprocess.run([TORCH_PYTHON, "-c", "import torch, numpy"],
                          capture_output=True).returncode == 0
  except OSError:
    return False


pytestmark = [
    pytest.mark.skipif(not os.path.isfile(AUTHORS_FILE),
                       reason="FAST_PALIMPSA_AUTHORS_FILE does not name the authors' file"),
    pytest.mark.skipif(not _torch_available(),
                       reason=f"no torch for FAST_PALIMPSA_TORCH_PYTHON={TORCH_PYTHON}"),
]


def _authors_inputs(seed, chunk_size) -> dict:
  b, t, h, kd, vd = SHAPE
  rng = np.random.default_rng(seed)
  return dict(
      q=rng.standard_normal((b, t, h, kd)) / np.sqrt(kd),
      k=rng.standard_normal((b, t, h, kd)) / np.sqrt(kd),
      v=rng.standard_normal((b, t, h, vd)), b=rng.uniform(0.0, 1.0, (b, t, h, vd)),
      gt=rng.uniform(0.01, 0.5, (b, t, h)), g=rng.uniform(0.5, 1.5, (h,)),
      Ip=rng.uniform(0.5, 2.0, (h,)), cot=rng.standard_normal((b, t, h, vd)),
      chunk_size=np.int64(chunk_size))


def _run_authors(x, tmp_path) -> dict:
  np.savez(tmp_path / "in.npz", **x)
  done = subprocess.run([TORCH_PYTHON, str(RUNNER), AUTHORS_FILE, str(tmp_path / "in.npz"),
                         str(tmp_path / "out.npz")], capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  return dict(np.load(tmp_path / "out.npz"))


def _ours(op, x, dtype) -> dict:
  """Our output and the grads of sum(out * cot), mapped to the authors' arguments."""

  def loss(q, k, v, beta, dt, ip):
    out = op(q, k, v, beta, -dt * jnp.asarray(x["g"], dtype), ip).out
    return jnp.sum(out * jnp.asarray(x["cot"], dtype)), out

  names = ("q", "k", "v", "b", "gt", "Ip")
  grads, out = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(
      *(jnp.asarray(x[n], dtype) for n in names))
  return dict(y=np.asarray(out), **{f"d{n}": np.asarray(g) for n, g in zip(names, grads)})


def _theirs(results, tag) -> dict:
  return {n.removeprefix(tag + "_"): a for n, a in results.items() if n.startswith(tag + "_")}


@pytest.mark.parametrize("chunk", CHUNKS)
def test_matches_the_authors_definition(chunk, tmp_path):
  x = _authors_inputs(chunk, chunk)
  theirs = _run_authors(x, tmp_path)
  with jax.enable_x64(True):
    ours64 = _ours(lambda *a: reference_fast_palimpsa(*a, chunk_size=chunk), x, jnp.float64)
    exact64 = _ours(reference_palimpsa, x, jnp.float64)
  ours32 = _ours(lambda *a: fast_palimpsa(*a, chunk_size=chunk), x, jnp.float32)
  for form in ("ref", "vec"):  # their loop reference and their vectorised form
    assert_close_to_reference(ours64, _theirs(theirs, f"{form}_float64"), FLOAT32_TOL,
                              f"reference vs their {form}, float64 ")
    want32 = _theirs(theirs, f"{form}_float32")
    assert_close_to_reference(ours32["y"], want32.pop("y"), FLOAT32_TOL,
                              f"chunked vs their {form}, float32 ")
    assert_close_to_reference({n: ours32[n] for n in want32}, want32, GRAD_TOL,
                              f"chunked vs their {form}, float32 ")
  # Their token-exact recurrence is our exact op's reference: the conventions map right.
  assert_close_to_reference(exact64, _theirs(theirs, "exact_float64"), FLOAT32_TOL,
                            "reference_palimpsa vs their exact recurrence ")

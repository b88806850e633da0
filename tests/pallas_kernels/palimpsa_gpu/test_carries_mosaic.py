"""The Mosaic GPU adjoint-carries kernel against the Triton one and a plain reverse loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.palimpsa_gpu import carries_mosaic, carries_triton


def _args(bh, num_chunks, vp, kw, seed=0):
  """dm_end, db_end [BH, Vp, Kw], chunk_gate [BH, NC], adj_m, adj_b [BH, NC, Vp, Kw]."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  ends = [jax.random.normal(key, (bh, vp, kw)) for key in keys[:2]]
  gate = jax.random.uniform(keys[2], (bh, num_chunks))
  local = [jax.random.normal(key, (bh, num_chunks, vp, kw)) for key in keys[3:]]
  return (*ends, gate, *local)


def _reverse_loop(*args):
  """The carries as a plain numpy loop over chunks, last first."""
  end_m, end_b, gate, local_m, local_b = (np.asarray(x) for x in args)
  cm, cb, carries_m, carries_b = end_m, end_b, [], []
  for c in reversed(range(gate.shape[1])):
    carries_m.append(cm)
    carries_b.append(cb)
    g = gate[:, c, None, None]
    cm, cb = local_m[:, c] + g * cm, local_b[:, c] + g * cb
  return (np.stack(carries_m[::-1], axis=1), np.stack(carries_b[::-1], axis=1), cm, cb)


def _check(got, want, tol):
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == jnp.float32
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


# (NC, Vp, Kw, tile, depth): one chunk (fewer than the ring holds), then chunk counts
# that are not multiples of the ring depth; one tile per state or several, with 16- and
# 8-byte register vectors (vec 4 and 2).
CASES = [(1, 16, 48, None, 4), (6, 48, 16, 256, 4), (9, 16, 96, 512, 3),
         (5, 48, 48, None, 2)]


@pytest.mark.parametrize("num_chunks, vp, kw, tile, depth", CASES)
def test_interpreted_matches_triton_and_a_reverse_loop(num_chunks, vp, kw, tile, depth):
  args = _args(1, num_chunks, vp, kw, seed=num_chunks)
  got = carries_mosaic.adjoint_carries(*args, interpret=True, tile=tile, depth=depth)
  _check(got, carries_triton.adjoint_carries(*args, block_v=16, interpret=True), 1e-6)
  _check(got, _reverse_loop(*args), 1e-6)


def test_interpreted_has_no_races(monkeypatch):
  """The ring's refills wait for the staged carries' copies (the race detector agrees)."""
  monkeypatch.setattr(plgpu, "InterpretGPUParams",
                      functools.partial(plgpu.InterpretGPUParams, detect_races=True))
  args = _args(1, 5, 16, 32)
  got = carries_mosaic.adjoint_carries(*args, interpret=True, tile=256, depth=3)
  jax.block_until_ready(got)
  assert not interpret_pallas_call.get_races().races_found
  _check(got, _reverse_loop(*args), 1e-6)


def test_rejects_a_tile_that_does_not_divide_the_state():
  state, local = jnp.zeros((1, 16, 48)), jnp.zeros((1, 2, 16, 48))
  with pytest.raises(ValueError, match="tile=512"):
    carries_mosaic.adjoint_carries(state, state, jnp.ones((1, 2)), local, local,
                                   interpret=True, tile=512)


@pytest.mark.parametrize("shape", [(64, 64, 192, 96), (512, 16, 32, 16), (64, 64, 48, 48)])
def test_lowers_for_cuda_without_triton(shape):
  """D760-, MQAR- and D170-like shapes lower to one Mosaic GPU kernel on a CPU host
  (Triton lowering would need a GPU)."""
  bh, nc, vp, kw = shape
  sds = jax.ShapeDtypeStruct
  args = ([sds((bh, vp, kw), jnp.float32)] * 2 + [sds((bh, nc), jnp.float32)]
          + [sds((bh, nc, vp, kw), jnp.float32)] * 2)
  f = functools.partial(carries_mosaic.adjoint_carries, interpret=False)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 1 and "triton" not in text.lower()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8, 64, 192, 96), (16, 16, 32, 16), (4, 7, 48, 48)])
def test_compiled_matches_triton_and_a_reverse_loop(shape):
  bh, nc, vp, kw = shape
  args = _args(bh, nc, vp, kw, seed=nc)
  got = jax.jit(functools.partial(carries_mosaic.adjoint_carries, interpret=False))(*args)
  triton = jax.jit(functools.partial(carries_triton.adjoint_carries, block_v=16,
                                     interpret=False))(*args)
  _check(got, triton, 1e-5)
  _check(got, _reverse_loop(*args), 1e-5)

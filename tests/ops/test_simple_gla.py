"""simple_gla (sequential and chunked) against a float64 recurrence and the SSD dual form."""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from palimpsa_jax.ops.simple_gla import SimpleGLAResult, simple_gla
from tests.ops.numerics import FLOAT32_TOL, assert_close_to_reference, to_float64
from tests.ops.oracles.ssd import ssd_quadratic
from tests.ops.recurrent_op_suite import B, CHUNK, H, K, T, V, OpInputs, RecurrentOpSuite


def _inputs(seed, time=T, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, time, H, K))
  k = rng.standard_normal((B, time, H, K)) / np.sqrt(K)
  v = rng.standard_normal((B, time, H, V))
  log_alpha = -rng.uniform(0.0, 0.5, (B, time, H))
  h0 = rng.standard_normal((B, H, V, K))
  seg = np.cumsum(rng.uniform(size=(B, time)) < 0.2, axis=1).astype(np.int32)
  floats = tuple(jnp.asarray(x, dtype) for x in (q, k, v, log_alpha))
  return floats + (jnp.asarray(h0, jnp.float32), jnp.asarray(seg))


def _recurrence(q, k, v, log_alpha, h0, seg):
  """The recurrence written directly from its definition, in the inputs' dtype."""
  reset = jnp.concatenate([jnp.zeros_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1)

  def step(h, xs):
    q_t, k_t, v_t, la_t, r_t = xs
    h = (jnp.exp(la_t) * (1.0 - r_t[:, None]))[:, :, None, None] * h
    h = h + jnp.einsum("bhv,bhk->bhvk", v_t, k_t)
    return h, jnp.einsum("bhvk,bhk->bhv", h, q_t)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, log_alpha, reset))
  state, out = lax.scan(step, h0, xs)
  return jnp.moveaxis(out, 0, 1), state


def _reference(*inputs):
  """float64 (out, state) as numpy arrays."""
  with jax.enable_x64(True):
    return tuple(np.asarray(x) for x in _recurrence(*to_float64(inputs)))


class TestSimpleGLA(RecurrentOpSuite):
  OP = staticmethod(simple_gla)

  def inputs(self, seed, time=T, dtype=jnp.float32):
    *sequences, h0, seg = _inputs(seed, time, dtype)
    return OpInputs(tuple(sequences), (), h0, seg)

  def reference(self, sequences, constants, state, segment_ids):
    return _recurrence(*sequences, *constants, state, segment_ids)


def test_ssd_dual_form_matches_recurrence():
  q, k, v, log_alpha, h0, seg = _inputs(7)
  ref_out, _ = _reference(q, k, v, log_alpha, jnp.zeros_like(h0), jnp.zeros_like(seg))
  with jax.enable_x64(True):
    out = ssd_quadratic(*(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, log_alpha)))
    assert_close_to_reference(out, ref_out, 1e-12)
  out = simple_gla(q, k, v, log_alpha, chunk_size=CHUNK)
  assert isinstance(out, SimpleGLAResult)
  assert_close_to_reference(out.out, ref_out, FLOAT32_TOL)


def test_validation_errors():
  q, k, v, log_alpha, h0, seg = _inputs(8, time=3)
  with pytest.raises(ValueError, match="q must"):
    simple_gla(q[0], k, v, log_alpha)
  with pytest.raises(ValueError, match="k must"):
    simple_gla(q, k[..., :2], v, log_alpha)
  with pytest.raises(ValueError, match="v must"):
    simple_gla(q, k, v[:, :2], log_alpha)
  with pytest.raises(ValueError, match=r"log_alpha must have shape \[B, T, H\]"):
    simple_gla(q, k, v, log_alpha[..., None])
  with pytest.raises(ValueError, match="initial_state"):
    simple_gla(q, k, v, log_alpha, initial_state=h0[..., :1])
  with pytest.raises(ValueError, match="segment_ids"):
    simple_gla(q, k, v, log_alpha, segment_ids=seg[:, :1])
  with pytest.raises(TypeError, match="segment_ids must have an integer dtype"):
    simple_gla(q, k, v, log_alpha, segment_ids=seg.astype(jnp.float32))
  with pytest.raises(TypeError, match="q must have a floating dtype"):
    simple_gla(q.astype(jnp.int32), k, v, log_alpha)
  with pytest.raises(ValueError, match="implementation"):
    simple_gla(q, k, v, log_alpha, implementation="pallas")
  with pytest.raises(ValueError, match="chunk_size"):
    simple_gla(q, k, v, log_alpha, chunk_size=0)
  with pytest.raises(ValueError, match="T >= 1"):
    simple_gla(q[:, :0], k[:, :0], v[:, :0], log_alpha[:, :0])

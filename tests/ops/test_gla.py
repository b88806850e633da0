"""simple_gla (sequential and chunked) against a float64 recurrence and the SSD dual form."""

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from palimpsa_jax.ops.gla import GLAResult, simple_gla
from palimpsa_jax.ops.ssd import ssd_quadratic
from tests.ops.numerics import rel_error, to_float64

B, T, H, K, V = 2, 13, 2, 4, 3
CHUNK = 4
IMPLEMENTATIONS = ("sequential", "chunked")


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


@functools.partial(jax.jit, static_argnames=("implementation", "chunk_size"))
def _run(q, k, v, log_alpha, h0, seg, implementation, chunk_size=CHUNK):
  return simple_gla(q, k, v, log_alpha, initial_state=h0, segment_ids=seg,
                    implementation=implementation, chunk_size=chunk_size)


def _loss(fn, weights):
  def loss(q, k, v, log_alpha, h0, seg):
    out, state = fn(q, k, v, log_alpha, h0, seg)
    return jnp.sum(out * weights[0]) + jnp.sum(state * weights[1])
  return loss


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_matches_float64_reference(implementation):
  inputs = _inputs(0)
  out, state = _run(*inputs, implementation=implementation)
  ref_out, ref_state = _reference(*inputs)
  assert out.dtype == jnp.float32 and state.dtype == jnp.float32
  assert out.shape == (B, T, H, V) and state.shape == (B, H, V, K)
  assert rel_error(out, ref_out) < 1e-5
  assert rel_error(state, ref_state) < 1e-5


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_chunk_sizes_agree(chunk_size):
  inputs = _inputs(1)
  out, state = _run(*inputs, implementation="chunked", chunk_size=chunk_size)
  ref_out, ref_state = _reference(*inputs)
  assert rel_error(out, ref_out) < 1e-5
  assert rel_error(state, ref_state) < 1e-5


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gradients_match_float64_reference(implementation):
  inputs = _inputs(2)
  rng = np.random.default_rng(3)
  weights = (rng.standard_normal((B, T, H, V)), rng.standard_normal((B, H, V, K)))
  argnums = (0, 1, 2, 3, 4)
  grads = jax.grad(
      _loss(functools.partial(_run, implementation=implementation), weights),
      argnums)(*inputs)

  with jax.enable_x64(True):
    ref_grads = jax.grad(_loss(_recurrence, weights), argnums)(*to_float64(inputs))
    ref_grads = [np.asarray(g) for g in ref_grads]
  for name, g, ref in zip(("q", "k", "v", "log_alpha", "initial_state"), grads, ref_grads):
    assert rel_error(g, ref) < 1e-4, name


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bfloat16_inputs(implementation):
  inputs = _inputs(4, dtype=jnp.bfloat16)
  out, state = _run(*inputs, implementation=implementation)
  ref_out, ref_state = _reference(*inputs)
  assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
  assert rel_error(out, ref_out) < 2e-2
  assert rel_error(state, ref_state) < 2e-2


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_continuation_from_final_state(implementation):
  q, k, v, log_alpha, h0, seg = _inputs(5)
  no_seg = jnp.zeros_like(seg)
  split = 6
  full = _run(q, k, v, log_alpha, h0, no_seg, implementation=implementation)
  first = simple_gla(q[:, :split], k[:, :split], v[:, :split], log_alpha[:, :split],
                     initial_state=h0, implementation=implementation, chunk_size=CHUNK)
  second = simple_gla(q[:, split:], k[:, split:], v[:, split:], log_alpha[:, split:],
                      initial_state=first.state, implementation=implementation,
                      chunk_size=CHUNK)
  np.testing.assert_allclose(
      jnp.concatenate([first.out, second.out], 1), full.out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(second.state, full.state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_segments_restart_from_zero(implementation):
  q, k, v, log_alpha, h0, _ = _inputs(6)
  split = 5  # inside the second chunk
  seg = jnp.asarray(np.repeat([[3] * split + [7] * (T - split)], B, axis=0), jnp.int32)
  packed = _run(q, k, v, log_alpha, h0, seg, implementation=implementation)
  head = simple_gla(q[:, :split], k[:, :split], v[:, :split], log_alpha[:, :split],
                    initial_state=h0, implementation=implementation, chunk_size=CHUNK)
  tail = simple_gla(q[:, split:], k[:, split:], v[:, split:], log_alpha[:, split:],
                    implementation=implementation, chunk_size=CHUNK)
  np.testing.assert_allclose(packed.out[:, :split], head.out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed.out[:, split:], tail.out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed.state, tail.state, rtol=1e-5, atol=1e-5)


def test_ssd_dual_form_matches_recurrence():
  q, k, v, log_alpha, h0, seg = _inputs(7)
  ref_out, _ = _reference(q, k, v, log_alpha, jnp.zeros_like(h0), jnp.zeros_like(seg))
  with jax.enable_x64(True):
    out = ssd_quadratic(*(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, log_alpha)))
    assert rel_error(out, ref_out) < 1e-12
  out = simple_gla(q, k, v, log_alpha, chunk_size=CHUNK)
  assert isinstance(out, GLAResult)
  assert rel_error(out.out, ref_out) < 1e-5


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

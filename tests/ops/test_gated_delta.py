"""gated_delta_rule (sequential and WY-chunked) against a float64 matrix-form recurrence."""

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from palimpsa_jax.ops.gated_delta import DeltaRuleResult, gated_delta_rule
from tests.ops.numerics import rel_error, to_float64

B, T, H, K, V = 2, 13, 2, 4, 3
CHUNK = 4
IMPLEMENTATIONS = ("sequential", "chunked")


def _inputs(seed, time=T, dtype=jnp.float32):
  """q, k (L2-normalised), v, beta in (0, 1), log_alpha, initial state, segment ids."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, time, H, K))
  k = rng.standard_normal((B, time, H, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((B, time, H, V))
  beta = rng.uniform(0.1, 1.0, (B, time, H))
  log_alpha = -rng.uniform(0.0, 0.5, (B, time, H))
  s0 = rng.standard_normal((B, H, V, K))
  seg = np.cumsum(rng.uniform(size=(B, time)) < 0.2, axis=1).astype(np.int32)
  floats = tuple(jnp.asarray(x, dtype) for x in (q, k, v, beta, log_alpha))
  return floats + (jnp.asarray(s0, jnp.float32), jnp.asarray(seg))


def _recurrence(q, k, v, beta, log_alpha, s0, seg):
  """S_t = a_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, with an explicit K x K matrix."""
  reset = jnp.concatenate([jnp.zeros_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1)
  eye = jnp.eye(q.shape[-1], dtype=q.dtype)

  def step(s, xs):
    q_t, k_t, v_t, b_t, la_t, r_t = xs
    a = jnp.exp(la_t) * (1.0 - r_t[:, None])
    transition = eye - b_t[..., None, None] * jnp.einsum("bhi,bhj->bhij", k_t, k_t)
    s = a[..., None, None] * jnp.einsum("bhvi,bhij->bhvj", s, transition)
    s = s + b_t[..., None, None] * jnp.einsum("bhv,bhk->bhvk", v_t, k_t)
    return s, jnp.einsum("bhvk,bhk->bhv", s, q_t)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, beta, log_alpha, reset))
  state, out = lax.scan(step, s0, xs)
  return jnp.moveaxis(out, 0, 1), state


def _reference(*inputs):
  """float64 (out, state) as numpy arrays."""
  with jax.enable_x64(True):
    return tuple(np.asarray(x) for x in _recurrence(*to_float64(inputs)))


@functools.partial(jax.jit, static_argnames=("implementation", "chunk_size"))
def _run(q, k, v, beta, log_alpha, s0, seg, implementation, chunk_size=CHUNK):
  return gated_delta_rule(q, k, v, beta, log_alpha, initial_state=s0, segment_ids=seg,
                          implementation=implementation, chunk_size=chunk_size)


def _loss(fn, weights):
  def loss(*inputs):
    out, state = fn(*inputs)
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
  argnums = (0, 1, 2, 3, 4, 5)
  grads = jax.grad(
      _loss(functools.partial(_run, implementation=implementation), weights), argnums)(*inputs)
  with jax.enable_x64(True):
    ref_grads = jax.grad(_loss(_recurrence, weights), argnums)(*to_float64(inputs))
    ref_grads = [np.asarray(g) for g in ref_grads]
  names = ("q", "k", "v", "beta", "log_alpha", "initial_state")
  for name, g, ref in zip(names, grads, ref_grads):
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
  q, k, v, beta, log_alpha, s0, seg = _inputs(5)
  split = 6
  full = _run(q, k, v, beta, log_alpha, s0, jnp.zeros_like(seg), implementation=implementation)
  run = functools.partial(gated_delta_rule, implementation=implementation, chunk_size=CHUNK)
  first = run(q[:, :split], k[:, :split], v[:, :split], beta[:, :split], log_alpha[:, :split],
              initial_state=s0)
  second = run(q[:, split:], k[:, split:], v[:, split:], beta[:, split:], log_alpha[:, split:],
               initial_state=first.state)
  np.testing.assert_allclose(
      jnp.concatenate([first.out, second.out], 1), full.out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(second.state, full.state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_segments_restart_from_zero(implementation):
  q, k, v, beta, log_alpha, s0, _ = _inputs(6)
  split = 5  # inside the second chunk
  seg = jnp.asarray(np.repeat([[3] * split + [7] * (T - split)], B, axis=0), jnp.int32)
  packed = _run(q, k, v, beta, log_alpha, s0, seg, implementation=implementation)
  run = functools.partial(gated_delta_rule, implementation=implementation, chunk_size=CHUNK)
  head = run(q[:, :split], k[:, :split], v[:, :split], beta[:, :split], log_alpha[:, :split],
             initial_state=s0)
  tail = run(q[:, split:], k[:, split:], v[:, split:], beta[:, split:], log_alpha[:, split:])
  assert isinstance(tail, DeltaRuleResult)
  np.testing.assert_allclose(packed.out[:, :split], head.out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed.out[:, split:], tail.out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed.state, tail.state, rtol=1e-5, atol=1e-5)


def test_validation_errors():
  q, k, v, beta, log_alpha, s0, seg = _inputs(8, time=3)
  with pytest.raises(ValueError, match="q must"):
    gated_delta_rule(q[0], k, v, beta, log_alpha)
  with pytest.raises(ValueError, match="k must"):
    gated_delta_rule(q, k[..., :2], v, beta, log_alpha)
  with pytest.raises(ValueError, match="v must"):
    gated_delta_rule(q, k, v[:, :2], beta, log_alpha)
  with pytest.raises(ValueError, match=r"beta must have shape \[B, T, H\]"):
    gated_delta_rule(q, k, v, beta[..., None], log_alpha)
  with pytest.raises(TypeError, match="beta must have a floating dtype"):
    gated_delta_rule(q, k, v, beta.astype(jnp.int32), log_alpha)
  with pytest.raises(ValueError, match=r"log_alpha must have shape \[B, T, H\]"):
    gated_delta_rule(q, k, v, beta, log_alpha[:, :1])
  with pytest.raises(ValueError, match="initial_state"):
    gated_delta_rule(q, k, v, beta, log_alpha, initial_state=s0[:, :1])
  with pytest.raises(TypeError, match="segment_ids must have an integer dtype"):
    gated_delta_rule(q, k, v, beta, log_alpha, segment_ids=seg.astype(jnp.float32))
  with pytest.raises(ValueError, match="implementation"):
    gated_delta_rule(q, k, v, beta, log_alpha, implementation="associative")
  with pytest.raises(TypeError, match="chunk_size"):
    gated_delta_rule(q, k, v, beta, log_alpha, chunk_size=4.0)

"""gated_delta_rule (sequential and WY-chunked) against a float64 matrix-form recurrence."""

from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from palimpsa_jax.ops.gated_delta_rule import GatedDeltaRuleResult, gated_delta_rule
from tests.ops.recurrent_op_suite import B, CHUNK, H, K, T, V, OpInputs, RecurrentOpSuite


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


class TestGatedDeltaRule(RecurrentOpSuite):
  OP = staticmethod(gated_delta_rule)

  def inputs(self, seed, time=T, dtype=jnp.float32):
    *sequences, s0, seg = _inputs(seed, time, dtype)
    return OpInputs(tuple(sequences), (), s0, seg)

  def reference(self, sequences, constants, state, segment_ids):
    return _recurrence(*sequences, *constants, state, segment_ids)

  def test_result_type(self):
    x = self.inputs(7)
    assert isinstance(gated_delta_rule(*x.sequences, chunk_size=CHUNK), GatedDeltaRuleResult)


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

"""mesa_net (exact sequential and CG-chunked) against a float64 literal least-squares oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from palimpsa_jax.ops.mesa_net import MesaNetResult, MesaState, mesa_net
from palimpsa_jax.ops.mesa_net.chunked import mesa_chunked
from palimpsa_jax.ops.mesa_net.sequential import mesa_sequential
from tests.ops.numerics import rel_error, to_float64
from tests.ops.recurrent_op_suite import B, CHUNK, H, K, T, V, OpInputs, RecurrentOpSuite


def _inputs(seed, time=T, dtype=jnp.float32):
  """q, k (unit), v, beta in (0.1, 1), log_gamma, lam [H, K], initial state, segment ids."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, time, H, K))
  k = rng.standard_normal((B, time, H, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((B, time, H, V))
  beta = rng.uniform(0.1, 1.0, (B, time, H))
  log_gamma = -rng.uniform(0.0, 0.5, (B, time, H))
  lam = rng.uniform(0.5, 1.5, (H, K))
  k0 = rng.standard_normal((B, H, K, 2 * K)) / np.sqrt(2 * K)
  kk0 = np.einsum("bhik,bhjk->bhij", k0, k0)  # positive semi-definite
  kv0 = rng.standard_normal((B, H, V, K))
  seg = np.cumsum(rng.uniform(size=(B, time)) < 0.2, axis=1).astype(np.int32)
  floats = tuple(jnp.asarray(x, dtype) for x in (q, k, v, beta, log_gamma, lam))
  return floats + (jnp.asarray(kk0, jnp.float32), jnp.asarray(kv0, jnp.float32),
                   jnp.asarray(seg))


def _oracle(q, k, v, beta, log_gamma, lam, kk0, kv0, seg):
  """numpy float64: the sums written out over the past of each step, then np.linalg.solve."""
  q, k, v, beta, log_gamma, lam, kk0, kv0 = (
      np.asarray(x, np.float64) for x in (q, k, v, beta, log_gamma, lam, kk0, kv0))
  seg = np.asarray(seg)
  out = np.zeros((B, q.shape[1], H, V))
  for b in range(B):
    for h in range(H):
      for t in range(q.shape[1]):
        first = np.flatnonzero(seg[b, : t + 1] == seg[b, t])[0]
        cum = np.cumsum(log_gamma[b, : t + 1, h])
        kk = np.exp(cum[t]) * kk0[b, h] if first == 0 else np.zeros((K, K))
        kv = np.exp(cum[t]) * kv0[b, h] if first == 0 else np.zeros((V, K))
        for j in range(first, t + 1):
          w = np.exp(cum[t] - cum[j]) * beta[b, j, h]
          kk = kk + w * np.outer(k[b, j, h], k[b, j, h])
          kv = kv + w * np.outer(v[b, j, h], k[b, j, h])
        out[b, t, h] = kv @ np.linalg.solve(kk + np.diag(lam[h]), q[b, t, h])
  return out


def _starts(seg):
  return jnp.pad(seg[:, 1:] != seg[:, :-1], ((0, 0), (1, 0)))


@functools.partial(jax.jit, static_argnames=("implementation", "chunk_size", "cg_steps"))
def _run(q, k, v, beta, log_gamma, lam, kk0, kv0, seg, implementation, chunk_size=CHUNK,
         cg_steps=K):
  return mesa_net(q, k, v, beta, log_gamma, lam, initial_state=MesaState(kk0, kv0),
                  segment_ids=seg, implementation=implementation, chunk_size=chunk_size,
                  cg_steps=cg_steps)


def _exact64(q, k, v, beta, log_gamma, lam, kk0, kv0, seg):
  """float64 sequential (exact solve) MesaNetResult; call inside enable_x64."""
  out, kk, kv = mesa_sequential(q, k, v, beta, log_gamma, lam, kk0, kv0, _starts(seg))
  return MesaNetResult(out, MesaState(kk, kv))


class TestMesaNet(RecurrentOpSuite):
  OP = staticmethod(mesa_net)
  OPTIONS = dict(cg_steps=K)  # exact after K steps

  def inputs(self, seed, time=T, dtype=jnp.float32):
    q, k, v, beta, log_gamma, lam, kk0, kv0, seg = _inputs(seed, time, dtype)
    return OpInputs((q, k, v, beta, log_gamma), (lam,), MesaState(kk0, kv0), seg)

  def reference(self, sequences, constants, state, segment_ids):
    result = _exact64(*sequences, *constants, *state, segment_ids)
    return result.out, result.state

  def comparable_gradients(self, gradients):
    """kk0 is symmetric; CG (unlike a general solve) answers only symmetric perturbations of
    it."""
    sequences, constants, state = gradients
    symmetric = (state.kk + np.swapaxes(state.kk, -1, -2)) / 2
    return sequences, constants, state._replace(kk=symmetric)


def test_float64_sequential_is_the_literal_least_squares_readout():
  inputs = _inputs(0)
  with jax.enable_x64(True):
    out = np.asarray(_exact64(*to_float64(inputs)).out)
  assert rel_error(out, _oracle(*inputs)) < 1e-12


def test_cg_error_falls_with_steps_and_is_exact_after_k_steps():
  """float64 CG against the exact solve: the error falls every step and vanishes at K steps."""
  inputs = _inputs(3)
  with jax.enable_x64(True):
    x64 = to_float64(inputs)
    ref = np.asarray(_exact64(*x64).out)
    *floats, seg = x64
    errors = [rel_error(mesa_chunked(*floats, _starts(seg), CHUNK, steps)[0], ref)
              for steps in range(K + 2)]
  assert errors[0] > 1e-2  # the diagonal start alone is not the solve
  assert all(later < earlier for earlier, later in zip(errors[:K], errors[1:K + 1]))
  assert errors[K] < 1e-12 and errors[K + 1] < 1e-12


def test_gradients_stay_finite_long_after_cg_converges():
  """30 steps on K = 4 keys (converged after 4), zero queries included: no NaN, still exact."""
  q, *rest = _inputs(9)
  q = q.at[:, :3].set(0.0)
  inputs = (q, *rest)
  grads = jax.grad(lambda *a: jnp.sum(_run(*a, implementation="chunked", cg_steps=30).out ** 2),
                   argnums=tuple(range(6)))(*inputs)
  with jax.enable_x64(True):
    ref = jax.grad(lambda *a: jnp.sum(_exact64(*a).out ** 2),
                   argnums=tuple(range(6)))(*to_float64(inputs))
  for name, g, r in zip(("q", "k", "v", "beta", "log_gamma", "lam"), grads, ref):
    assert np.all(np.isfinite(g)), name
    assert rel_error(g, r) < 1e-4, name


def test_validation_errors():
  q, k, v, beta, log_gamma, lam, kk0, kv0, seg = _inputs(8, time=3)
  with pytest.raises(ValueError, match="k must"):
    mesa_net(q, k[..., :2], v, beta, log_gamma, lam)
  with pytest.raises(ValueError, match=r"beta must have shape \[B, T, H\]"):
    mesa_net(q, k, v, beta[..., None], log_gamma, lam)
  with pytest.raises(ValueError, match=r"log_gamma must have shape \[B, T, H\]"):
    mesa_net(q, k, v, beta, log_gamma[:, :1], lam)
  with pytest.raises(ValueError, match=r"lam must have shape \[H, K\]"):
    mesa_net(q, k, v, beta, log_gamma, lam[0])
  with pytest.raises(ValueError, match=r"initial_state.kk must have shape \[B, H, K, K\]"):
    mesa_net(q, k, v, beta, log_gamma, lam, initial_state=MesaState(kv0, kv0))
  with pytest.raises(TypeError, match="segment_ids must have an integer dtype"):
    mesa_net(q, k, v, beta, log_gamma, lam, segment_ids=seg.astype(jnp.float32))
  with pytest.raises(ValueError, match="implementation"):
    mesa_net(q, k, v, beta, log_gamma, lam, implementation="associative")
  with pytest.raises(ValueError, match="cg_steps must be a non-negative int"):
    mesa_net(q, k, v, beta, log_gamma, lam, cg_steps=-1)

"""The paper's special cases (docs/math.md, special cases), made executable.

- beta = 0: Palimpsa is the SSD / SimpleGLA recurrence divided by Ip (checked against the SSD's
  quadratic dual form, written without any scan).
- Mamba2 limit: for beta > 0 fixed, Ip * out -> SSD output as Ip grows, with error O(1/Ip).
- Longhorn: Palimpsa with alpha = 1, Ip = 1 and value beta * v takes Longhorn's step with a
  per-entry instead of a per-row normaliser (see tests/ops/oracles/longhorn.py).
- DeltaNet is the gated delta rule with log_alpha = 0.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from palimpsa_jax.ops import PalimpsaState, gated_delta_rule, palimpsa, simple_gla
from tests.ops.oracles.longhorn import longhorn
from tests.ops.oracles.ssd import ssd_quadratic
from tests.ops.numerics import FLOAT32_TOL, assert_close_to_reference, rel_error

B, T, H, K, V = 2, 11, 2, 4, 3
CHUNK = 4
IMPLEMENTATIONS = ("sequential", "chunked")


def _sequences(seed, time=T):
  """float32 q, k, v [B, T, H, K|V], beta [B, T, H, V] in (0.2, 1), log_alpha [B, T, H]."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, time, H, K))
  k = rng.standard_normal((B, time, H, K)) / np.sqrt(K)
  v = rng.standard_normal((B, time, H, V))
  beta = rng.uniform(0.2, 1.0, (B, time, H, V))
  log_alpha = -rng.uniform(0.0, 0.5, (B, time, H))
  return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, beta, log_alpha))


def _ssd64(q, k, v, log_alpha):
  """SSD dual form in float64, as numpy."""
  with jax.enable_x64(True):
    args = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, log_alpha))
    return np.asarray(ssd_quadratic(*args))


@functools.partial(jax.jit, static_argnames=("implementation", "zero_beta"))
def _palimpsa_beta0(q, k, v, log_alpha, prior_precision, implementation, zero_beta):
  beta = jnp.zeros_like(v) if zero_beta else None
  return palimpsa(q, k, v, beta, log_alpha, prior_precision, implementation=implementation,
                  chunk_size=CHUNK)


@pytest.mark.parametrize("zero_beta", [True, False], ids=["zeros", "none"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_beta_zero_is_ssd_over_prior_precision(implementation, zero_beta):
  q, k, v, _, log_alpha = _sequences(0)
  prior = jnp.asarray([0.5, 2.0], jnp.float32)
  result = _palimpsa_beta0(q, k, v, log_alpha, prior, implementation, zero_beta)
  expected = _ssd64(q, k, v, log_alpha) / np.asarray(prior)[:, None]
  assert_close_to_reference(result.out, expected, FLOAT32_TOL)
  chex.assert_trees_all_close(result.state.precision, np.broadcast_to(
      np.asarray(prior)[:, None, None], (B, H, V, K)), rtol=1e-6)
  gla = simple_gla(q, k, v, log_alpha, chunk_size=CHUNK)
  assert_close_to_reference(result.state.mu, gla.state / prior[:, None, None], FLOAT32_TOL)


def test_beta_zero_with_unit_prior_is_simple_gla():
  q, k, v, _, log_alpha = _sequences(1)
  result = _palimpsa_beta0(q, k, v, log_alpha, jnp.ones((H,), jnp.float32), "chunked", True)
  gla = simple_gla(q, k, v, log_alpha, chunk_size=CHUNK)
  assert_close_to_reference(result.out, gla.out, FLOAT32_TOL)
  assert_close_to_reference(result.state.mu, gla.state, FLOAT32_TOL)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_mamba2_limit_error_decays_like_one_over_prior(implementation):
  """I_t = Ip + Ibar_t with Ibar_t independent of Ip, so Ip * out = h q (1 - Ibar/Ip + ...)."""
  q, k, v, beta, log_alpha = _sequences(2)
  ssd = _ssd64(q, k, v, log_alpha)
  priors = np.array([1e1, 1e2, 1e3, 1e4])
  errors = []
  for prior in priors:
    ip = jnp.full((H,), prior, jnp.float32)
    out = palimpsa(q, k, v, beta, log_alpha, ip, implementation=implementation,
                   chunk_size=CHUNK).out
    errors.append(rel_error(prior * np.asarray(out, np.float64), ssd))
  slope = np.polyfit(np.log(priors), np.log(errors), 1)[0]
  last_slope = np.log(errors[-1] / errors[-2]) / np.log(priors[-1] / priors[-2])
  assert errors[-1] < 1e-3
  assert abs(slope + 1.0) < 0.05, (slope, errors)
  assert abs(last_slope + 1.0) < 0.01, (last_slope, errors)


def _longhorn64(q, k, v, beta, mu0):
  """Longhorn's update written out entry by entry in float64 numpy."""
  q, k, v, beta, mu = (np.asarray(x, np.float64) for x in (q, k, v, beta, mu0))
  out = np.zeros(v.shape)
  for t in range(q.shape[1]):
    k_t = k[:, t]  # [B, H, K]
    eps = beta[:, t] / (1.0 + beta[:, t] * np.sum(k_t**2, -1)[..., None])  # [B, H, V]
    mu = (1.0 - eps[..., :, None] * k_t[..., None, :]**2) * mu
    mu = mu + (eps * v[:, t])[..., :, None] * k_t[..., None, :]
    out[:, t] = np.einsum("bhvk,bhk->bhv", mu, q[:, t])
  return out, mu


def test_longhorn_matches_its_definition():
  q, k, v, beta, _ = _sequences(3)
  mu0 = jnp.asarray(np.random.default_rng(4).standard_normal((B, H, V, K)), jnp.float32)
  out, state = longhorn(q, k, v, beta, initial_state=mu0)
  ref_out, ref_state = _longhorn64(q, k, v, beta, mu0)
  assert_close_to_reference(out, ref_out, FLOAT32_TOL)
  assert_close_to_reference(state, ref_state, FLOAT32_TOL)


def test_longhorn_validation():
  q, k, v, beta, _ = _sequences(11, time=2)
  with pytest.raises(ValueError, match=r"beta must have shape \[B, T, H, V\]"):
    longhorn(q, k, v, beta[..., 0])
  with pytest.raises(ValueError, match="initial_state"):
    longhorn(q, k, v, beta, initial_state=jnp.zeros((B, H, K, V)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_one_palimpsa_step_is_longhorn_with_per_entry_normaliser(implementation):
  q, k, v, beta, _ = (x[:, :1] for x in _sequences(5))
  mu0 = np.random.default_rng(6).standard_normal((B, H, V, K))
  ones = jnp.ones((B, H, V, K), jnp.float32)
  result = palimpsa(q, k, beta * v, beta, jnp.zeros((B, 1, H), jnp.float32),
                    jnp.ones((H,), jnp.float32),
                    initial_state=PalimpsaState(jnp.asarray(mu0, jnp.float32), ones),
                    implementation=implementation, chunk_size=CHUNK)
  # Diagonal-precision step: Longhorn's formula with 1 + beta k.k replaced by 1 + beta k^2.
  k2 = np.asarray(k[:, 0], np.float64)[..., None, :]**2  # [B, H, 1, K]
  b = np.asarray(beta[:, 0], np.float64)[..., :, None]  # [B, H, V, 1]
  precision = 1.0 + b * k2
  mu = (1.0 - b * k2 / precision) * mu0 + (
      b * np.asarray(v[:, 0], np.float64)[..., None] * np.asarray(k[:, 0])[..., None, :]
  ) / precision
  assert_close_to_reference(result.state.mu, mu, FLOAT32_TOL)
  assert_close_to_reference(result.state.precision, precision, 1e-6)
  assert_close_to_reference(result.out[:, 0], np.einsum("bhvk,bhk->bhv", mu, q[:, 0]),
                            FLOAT32_TOL)
  # For a generic key the row normaliser of Longhorn is strictly larger, so the two differ.
  with pytest.raises(AssertionError):
    assert_close_to_reference(
        longhorn(q, k, v, beta, initial_state=jnp.asarray(mu0, jnp.float32)).state, mu, 1e-3)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_palimpsa_equals_longhorn_on_distinct_basis_keys(implementation):
  """Keys scale distinct basis vectors: every written entry sees precision 1 beforehand."""
  q, _, v, beta, _ = (x[:, :K] for x in _sequences(7))
  scales = np.random.default_rng(8).uniform(0.5, 2.0, (B, K, H, 1))
  k = jnp.asarray(scales * np.eye(K)[None, :, None, :], jnp.float32)  # [B, K(time), H, K]
  zeros = jnp.zeros((B, K, H), jnp.float32)
  result = palimpsa(q, k, beta * v, beta, zeros, jnp.ones((H,), jnp.float32),
                    implementation=implementation, chunk_size=CHUNK)
  expected = longhorn(q, k, v, beta)
  assert_close_to_reference(result.out, expected.out, FLOAT32_TOL)
  assert_close_to_reference(result.state.mu, expected.state, FLOAT32_TOL)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_deltanet_is_gated_delta_rule_without_decay(implementation):
  q, k, v, beta, _ = _sequences(9)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  beta = beta[..., 0]  # DeltaNet's beta is a scalar per head and step
  s0 = np.random.default_rng(10).standard_normal((B, H, V, K))
  result = gated_delta_rule(q, k, v, beta, jnp.zeros((B, T, H), jnp.float32),
                            initial_state=jnp.asarray(s0, jnp.float32),
                            implementation=implementation, chunk_size=CHUNK)
  # DeltaNet, S_t = S_{t-1} (I - beta k k^T) + beta v k^T, in float64 numpy.
  s = s0
  out = np.zeros((B, T, H, V))
  q64, k64, v64, b64 = (np.asarray(x, np.float64) for x in (q, k, v, beta))
  for t in range(T):
    kk = np.einsum("bhi,bhj->bhij", k64[:, t], k64[:, t])
    s = s @ (np.eye(K) - b64[:, t, :, None, None] * kk)
    s = s + b64[:, t, :, None, None] * np.einsum("bhv,bhk->bhvk", v64[:, t], k64[:, t])
    out[:, t] = np.einsum("bhvk,bhk->bhv", s, q64[:, t])
  assert_close_to_reference(result.out, out, FLOAT32_TOL)
  assert_close_to_reference(result.state, s, FLOAT32_TOL)

"""Palimpsa's diagonal posterior as the diagonal approximation of MesaNet's full posterior.

With Palimpsa's value beta_t v_t, its beta beta_t (the same for every value row), log_alpha =
log_gamma and Ip = lam (one value per head):
- its precision I_t[v, :] is the diagonal of MesaNet's H_t + lam I for every row v, and its mean
  is G_t diag(H_t + lam)^{-1}: MesaNet's readout with the solve replaced by the diagonal one,
  which is MesaNet's chunked form with zero CG steps, for any keys;
- where every key is a scaled basis vector, H_t is diagonal and the two posteriors are equal;
- otherwise they differ, to first order in the keys' off-basis part;
- as lam grows, lam * MesaNet's readout tends to the linear attention G_t q_t (Palimpsa with
  beta = 0, the SimpleGLA case), with error O(1/lam).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from palimpsa_jax.ops import mesa_net, palimpsa
from palimpsa_jax.ops.mesa_net.sequential import mesa_sequential
from palimpsa_jax.ops.palimpsa.reference import reference_palimpsa
from tests.ops.numerics import rel_error

B, T, H, K, V = 2, 12, 2, 8, 3


def _inputs(seed, off_basis=None, lam=1.0, time=T, key_dim=K):
  """float64 numpy q, k (unit), v, beta, log_gamma and lam [H, K] (= lam).

  off_basis=None: Gaussian keys; a number e: basis vectors plus e times Gaussian noise.
  """
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, time, H, key_dim))
  if off_basis is None:
    k = rng.standard_normal((B, time, H, key_dim))
  else:
    k = (np.eye(key_dim)[rng.integers(0, key_dim, (B, time, H))]
         + off_basis * rng.standard_normal((B, time, H, key_dim)))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((B, time, H, V))
  beta = rng.uniform(0.2, 1.0, (B, time, H))
  log_gamma = -rng.uniform(0.0, 0.3, (B, time, H))
  return q, k, v, beta, log_gamma, np.full((H, key_dim), lam)


def _as_palimpsa(q, k, v, beta, log_gamma, lam):
  """The Palimpsa arguments of the correspondence above."""
  return (q, k, beta[..., None] * v, np.broadcast_to(beta[..., None], v.shape).copy(),
          log_gamma, lam[:, 0])


def _exact64(q, k, v, beta, log_gamma, lam):
  """float64 MesaNet (exact solve): (out, H, G) as numpy."""
  b, t, h, kd = q.shape
  with jax.enable_x64(True):
    args = [jnp.asarray(x) for x in (q, k, v, beta, log_gamma, lam)]
    result = mesa_sequential(*args, jnp.zeros((b, h, kd, kd)), jnp.zeros((b, h, v.shape[-1], kd)),
                             jnp.zeros((b, t), bool))
    return tuple(np.asarray(x) for x in result)


def _palimpsa64(*inputs):
  with jax.enable_x64(True):
    result = reference_palimpsa(*(jnp.asarray(x) for x in _as_palimpsa(*inputs)))
    return np.asarray(result.out), np.asarray(result.state.precision)


def diagonal_gap(inputs) -> float:
  """max |Palimpsa out - MesaNet out| / max |MesaNet out| in float64 (corresponding arguments)."""
  return rel_error(_palimpsa64(*inputs)[0], _exact64(*inputs)[0])


def test_palimpsa_precision_is_the_diagonal_of_mesanet_precision():
  inputs = _inputs(0, lam=0.7)
  _, kk, _ = _exact64(*inputs)
  _, precision = _palimpsa64(*inputs)
  diagonal = np.diagonal(kk, axis1=-2, axis2=-1) + 0.7  # [B, H, K]
  np.testing.assert_allclose(precision, np.broadcast_to(diagonal[:, :, None], precision.shape),
                             rtol=1e-12)


def test_zero_cg_steps_is_palimpsa_for_any_keys():
  inputs = _inputs(1)
  f32 = [jnp.asarray(x, jnp.float32) for x in inputs]
  mesa = mesa_net(*f32, implementation="chunked", chunk_size=5, cg_steps=0).out
  ours = palimpsa(*(jnp.asarray(x, jnp.float32) for x in _as_palimpsa(*inputs)),
                  implementation="chunked", chunk_size=5).out
  assert rel_error(mesa, _palimpsa64(*inputs)[0]) < 1e-5
  assert rel_error(ours, _palimpsa64(*inputs)[0]) < 1e-5
  assert rel_error(mesa, _exact64(*inputs)[0]) > 0.05  # and it is not the full solve


@pytest.mark.parametrize("lam", [0.25, 2.0])
def test_basis_keys_make_the_posteriors_equal(lam):
  inputs = _inputs(2, off_basis=0.0, lam=lam)
  assert diagonal_gap(inputs) < 1e-12
  f32 = [jnp.asarray(x, jnp.float32) for x in inputs]
  chunked = mesa_net(*f32, implementation="chunked", chunk_size=5, cg_steps=K).out
  ours = palimpsa(*(jnp.asarray(x, jnp.float32) for x in _as_palimpsa(*inputs)),
                  implementation="chunked", chunk_size=5).out
  assert rel_error(chunked, ours) < 1e-5


def test_gap_is_first_order_in_the_off_basis_part_of_the_keys():
  small, double = (diagonal_gap(_inputs(3, off_basis=e)) for e in (0.01, 0.02))
  assert 1e-3 < small < 0.1
  assert 1.8 < double / small < 2.2
  assert diagonal_gap(_inputs(3)) > 0.1  # Gaussian keys: far apart


def test_large_lam_tends_to_linear_attention():
  gaps = []
  for lam in (1e2, 1e3):
    q, k, v, beta, log_gamma, lams = _inputs(4, lam=lam)
    with jax.enable_x64(True):
      linear = reference_palimpsa(*(jnp.asarray(x) for x in (q, k, beta[..., None] * v)), None,
                                  jnp.asarray(log_gamma), jnp.ones((H,))).out
    gaps.append(rel_error(lam * _exact64(q, k, v, beta, log_gamma, lams)[0], np.asarray(linear)))
  assert gaps[0] < 0.1 and 8 < gaps[0] / gaps[1] < 12

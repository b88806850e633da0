"""Palimpsa with `jax.lax.associative_scan` over time on (alpha, M, Ibar).

Materialises every state, O(T*V*K) memory: meant for checking and short sequences.
"""

import jax

from palimpsa_jax.ops.linear_form import readout


def _combine(earlier, later):
  a1, m1, b1 = earlier
  a2, m2, b2 = later
  g = a2[..., None, None]
  return a1 * a2, g * m1 + m2, g * b1 + b2


def palimpsa_associative(q, k, v, beta, gate, prior_precision, m0, ibar0, *, return_variance,
                         chunk_size=None):
  """Parallel prefix over time. Shapes as in linear_form; chunk_size is unused."""
  del chunk_size
  dm = v[..., :, None] * k[..., None, :]  # [B,T,H,V,K]
  dibar = beta[..., :, None] * (k * k)[..., None, :]
  g0 = gate[:, :1, :, None, None]
  # Fold the initial state into the first element so the prefix needs no extra carry.
  dm = dm.at[:, :1].add(g0 * m0[:, None])
  dibar = dibar.at[:, :1].add(g0 * ibar0[:, None])
  _, m, ibar = jax.lax.associative_scan(_combine, (gate, dm, dibar), axis=1)
  out, var = readout(m, ibar, prior_precision[:, None, None], q, return_variance)
  return out, var, m[:, -1], ibar[:, -1]

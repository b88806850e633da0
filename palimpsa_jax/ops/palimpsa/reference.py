"""Plain sequential Palimpsa in the literal form of docs/math.md: the test oracle.

Runs in the dtype it is given (tests call it with float64 inside `jax.enable_x64(True)`), carries
(mu, I) directly rather than the linear form the fast implementations use.
"""

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.palimpsa_contract import PalimpsaResult, PalimpsaState


def reference_palimpsa(q, k, v, beta, log_alpha, prior_precision, *, initial_state=None,
                       segment_ids=None) -> PalimpsaResult:
  """Literal recurrence. q, k [B,T,H,K]; v, beta [B,T,H,V]; log_alpha [B,T,H]; prior [H].

  beta=None means beta == 0. Returns out and variance [B,T,H,V] and the state [B,H,V,K], all in
  the dtype of the inputs (no casts).
  """
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  if beta is None:
    beta = jnp.zeros_like(v)
  ip = prior_precision[None, :, None, None]  # [1,H,1,1]
  if initial_state is None:
    mu0 = jnp.zeros((b, h, vd, kd), v.dtype)
    i0 = jnp.broadcast_to(ip, (b, h, vd, kd)).astype(v.dtype)
  else:
    mu0, i0 = initial_state
  if segment_ids is None:
    reset = jnp.zeros((b, t), bool)
  else:
    reset = jnp.concatenate(
        [jnp.zeros((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)

  def step(carry, x):
    mu, prec = carry
    q_t, k_t, v_t, beta_t, la_t, reset_t = x
    r = reset_t[:, None, None, None]
    mu = jnp.where(r, 0.0, mu)
    prec = jnp.where(r, ip, prec)
    a = jnp.exp(la_t)[:, :, None, None]
    new_prec = a * prec + (1 - a) * ip + beta_t[..., :, None] * k_t[..., None, :] ** 2
    mu = a * (prec / new_prec) * mu + (v_t[..., :, None] * k_t[..., None, :]) / new_prec
    out = jnp.einsum("bhvk,bhk->bhv", mu, q_t)
    var = jnp.einsum("bhvk,bhk->bhv", 1.0 / new_prec, q_t ** 2)
    return (mu, new_prec), (out, var)

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  xs = tuple(map(time_major, (q, k, v, beta, log_alpha, reset)))
  (mu, prec), (out, var) = jax.lax.scan(step, (mu0, i0), xs)
  return PalimpsaResult(time_major(out), time_major(var), PalimpsaState(mu, prec))

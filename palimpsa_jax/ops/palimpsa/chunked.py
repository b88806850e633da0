"""Chunked Palimpsa in XLA with a memory-lean custom VJP.

Layout inside: [B, H, N, C, ...] (N chunks of C steps). Forward:
1. chunk-boundary states as matmuls (SPEC.md section 2):
   M_end = P * M_start + (V * w)^T K,  Ibar_end = P * Ibar_start + (Beta * w)^T K^2,
   w_t = prod_{s>t} a_s within the chunk, P = prod of the chunk's gates; a scan across chunks
   strings them together;
2. all chunks in parallel walk their C steps from their start state, dividing by I_t and reading
   out at every step (the division is per step, so this part cannot be a matmul).
The backward keeps only the inputs and the N start states: a reverse scan over chunks recomputes
one chunk's C states at a time and walks the adjoint back through it. Per batch-head that is
O(N*V*K + C*V*K) memory instead of O(T*V*K).
"""

import functools

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.palimpsa.linear_form import readout

_HIGHEST = jax.lax.Precision.HIGHEST


def _outer(x, y):
  """[..., V], [..., K] -> [..., V, K]."""
  return x[..., :, None] * y[..., None, :]


def _start_states(k, v, beta, gate, m0, ibar0):
  """Start state of every chunk. k [B,H,N,C,K], v/beta [B,H,N,C,V], gate [B,H,N,C].

  Returns (m_starts, ibar_starts) [B,H,N,V,K] and the final (m, ibar) [B,H,V,K].
  """
  suffix = jax.lax.cumprod(gate, axis=3, reverse=True)  # prod_{s>=t}
  decay = suffix[..., 0]  # [B,H,N]
  w = jnp.concatenate([suffix[..., 1:], jnp.ones_like(suffix[..., :1])], axis=3)[..., None]
  dm = jnp.einsum("bhncv,bhnck->bhnvk", v * w, k, precision=_HIGHEST)
  dibar = jnp.einsum("bhncv,bhnck->bhnvk", beta * w, k * k, precision=_HIGHEST)

  def step(carry, x):
    m, ibar = carry
    p, dm_n, dibar_n = x
    p = p[..., None, None]
    return (p * m + dm_n, p * ibar + dibar_n), (m, ibar)

  chunk_major = lambda x: jnp.moveaxis(x, 2, 0)
  final, starts = jax.lax.scan(step, (m0, ibar0), tuple(map(chunk_major, (decay, dm, dibar))))
  return tuple(jnp.moveaxis(s, 0, 2) for s in starts), final


def _walk(q, k, v, beta, gate, ip, m_starts, ibar_starts, return_variance):
  """Walks every chunk from its start state; outputs [B,H,N,C,V]."""

  def step(carry, x):
    m, ibar = carry
    q_t, k_t, v_t, beta_t, a_t = x
    a = a_t[..., None, None]
    m = a * m + _outer(v_t, k_t)
    ibar = a * ibar + _outer(beta_t, k_t * k_t)
    return (m, ibar), readout(m, ibar, ip, q_t, return_variance)

  step_major = lambda x: jnp.moveaxis(x, 3, 0)
  _, (out, var) = jax.lax.scan(step, (m_starts, ibar_starts),
                               tuple(map(step_major, (q, k, v, beta, gate))))
  back = lambda x: None if x is None else jnp.moveaxis(x, 0, 3)
  return back(out), back(var)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _chunked_core(q, k, v, beta, gate, prior_precision, m0, ibar0, return_variance):
  out, _ = _chunked_fwd(q, k, v, beta, gate, prior_precision, m0, ibar0, return_variance)
  return out


def _chunked_fwd(q, k, v, beta, gate, prior_precision, m0, ibar0, return_variance):
  (m_starts, ibar_starts), (m_end, ibar_end) = _start_states(k, v, beta, gate, m0, ibar0)
  ip = prior_precision[None, :, None, None, None]
  out, var = _walk(q, k, v, beta, gate, ip, m_starts, ibar_starts, return_variance)
  residuals = (q, k, v, beta, gate, prior_precision, m_starts, ibar_starts)
  return (out, var, m_end, ibar_end), residuals


def _chunked_bwd(return_variance, residuals, cotangents):
  q, k, v, beta, gate, prior_precision, m_starts, ibar_starts = residuals
  d_out, d_var, d_m_end, d_ibar_end = cotangents
  ip = prior_precision[None, :, None, None]  # against [B,H,V,K]
  if not return_variance:
    d_var = jnp.zeros_like(d_out)

  def chunk_step(carry, x):
    """Reverse through one chunk; carry = cotangent of the state after the chunk."""
    q_c, k_c, v_c, beta_c, a_c, do_c, dvar_c, m_start, ibar_start = x

    def recompute(s, y):
      k_t, v_t, beta_t, a_t = y
      a = a_t[..., None, None]
      s = (a * s[0] + _outer(v_t, k_t), a * s[1] + _outer(beta_t, k_t * k_t))
      return s, s

    step_major = lambda z: jnp.moveaxis(z, 2, 0)  # [B,H,C,...] -> [C,B,H,...]
    xs = tuple(map(step_major, (q_c, k_c, v_c, beta_c, a_c, do_c, dvar_c)))
    _, (ms, ibars) = jax.lax.scan(recompute, (m_start, ibar_start), xs[1:5])
    m_prev = jnp.concatenate([m_start[None], ms[:-1]], axis=0)
    ibar_prev = jnp.concatenate([ibar_start[None], ibars[:-1]], axis=0)

    def adjoint(lam, y):
      lam_m, lam_b = lam
      q_t, k_t, v_t, beta_t, a_t, do_t, dvar_t, m_t, ibar_t, mp, ibp = y
      r = 1.0 / (ibar_t + ip)
      mu = m_t * r
      dmu = _outer(do_t, q_t)
      dq = jnp.sum(do_t[..., :, None] * mu, axis=-2)
      dq += 2.0 * q_t * jnp.sum(dvar_t[..., :, None] * r, axis=-2)
      d_prec = -r * (dmu * mu + _outer(dvar_t, q_t * q_t) * r)
      lam_m = lam_m + dmu * r
      lam_b = lam_b + d_prec
      dv = jnp.sum(lam_m * k_t[..., None, :], axis=-1)
      dbeta = jnp.sum(lam_b * (k_t * k_t)[..., None, :], axis=-1)
      dk = (jnp.sum(lam_m * v_t[..., :, None], axis=-2)
            + 2.0 * k_t * jnp.sum(lam_b * beta_t[..., :, None], axis=-2))
      da = jnp.sum(lam_m * mp + lam_b * ibp, axis=(-2, -1))
      dip = jnp.sum(d_prec, axis=(-2, -1))
      a = a_t[..., None, None]
      return (a * lam_m, a * lam_b), (dq, dk, dv, dbeta, da, dip)

    lam, grads = jax.lax.scan(adjoint, carry, xs + (ms, ibars, m_prev, ibar_prev), reverse=True)
    return lam, tuple(jnp.moveaxis(g, 0, 2) for g in grads)  # back to [B,H,C,...]

  chunk_major = lambda z: jnp.moveaxis(z, 2, 0)  # [B,H,N,...] -> [N,B,H,...]
  xs = tuple(map(chunk_major, (q, k, v, beta, gate, d_out, d_var, m_starts, ibar_starts)))
  (d_m0, d_ibar0), grads = jax.lax.scan(chunk_step, (d_m_end, d_ibar_end), xs, reverse=True)
  dq, dk, dv, dbeta, dgate, dip = (jnp.moveaxis(g, 0, 2) for g in grads)
  d_prior = jnp.sum(dip, axis=(0, 2, 3))
  return dq, dk, dv, dbeta, dgate, d_prior, d_m0, d_ibar0


_chunked_core.defvjp(_chunked_fwd, _chunked_bwd)


def palimpsa_chunked(q, k, v, beta, gate, prior_precision, m0, ibar0, *, return_variance,
                     chunk_size):
  """Chunked Palimpsa for any T (padded with neutral steps a=1, k=v=beta=q=0, sliced back).

  Shapes as in linear_form.
  """
  b, t, h, _ = q.shape
  c = min(chunk_size, t)
  n = -(-t // c)
  pad = n * c - t

  def to_chunks(x, fill):
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    x = x.reshape((b, n, c) + x.shape[2:])
    return jnp.moveaxis(x, 3, 1)  # [B,N,C,H,...] -> [B,H,N,C,...]

  chunks = [to_chunks(x, 0.0) for x in (q, k, v, beta)] + [to_chunks(gate, 1.0)]
  out, var, m_end, ibar_end = _chunked_core(*chunks, prior_precision, m0, ibar0,
                                            return_variance)

  def from_chunks(x):
    x = jnp.moveaxis(x, 1, 3).reshape((b, n * c, h) + x.shape[4:])
    return x[:, :t]

  return from_chunks(out), None if var is None else from_chunks(var), m_end, ibar_end

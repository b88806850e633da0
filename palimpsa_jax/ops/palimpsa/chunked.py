"""Chunked Palimpsa in XLA with a memory-lean custom VJP.

Layout inside: inputs [C, N, B, H, ...] (N chunks of C steps, step-major so every walk scans over
the leading axis without copies); states of all chunks [N, B, H, V, K]. Forward:
1. chunk-boundary states as matmuls (docs/math.md):
   M_end = P * M_start + (V * w)^T K,  Ibar_end = P * Ibar_start + (Beta * w)^T K^2,
   w_t = prod_{s>t} a_s within the chunk, P = prod of the chunk's gates; a scan across chunks
   strings them together;
2. all chunks in parallel walk their C steps from their start state, dividing by I_t and reading
   out at every step (the division is per step, so this part cannot be a matmul).
The backward keeps only the inputs and the N start states and recomputes states (see
_chunked_bwd): per batch-head O(N*V*K + G*C*V*K) memory instead of O(T*V*K), with G = N / 32
chunks (at least 1) recomputed at once.
"""

import functools

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.linear_form import readout, scan_chunk_states

_HIGHEST = jax.lax.Precision.HIGHEST
# The backward recomputes the states of N / _BACKWARD_GROUPS chunks at a time.
_BACKWARD_GROUPS = 32


def _outer(x, y):
  """[..., V], [..., K] -> [..., V, K]."""
  return x[..., :, None] * y[..., None, :]


def _step(m, ibar, k_t, v_t, beta_t, a_t):
  """One update of the linear form; a_t has the shape of the state without [V, K]."""
  a = a_t[..., None, None]
  return a * m + _outer(v_t, k_t), a * ibar + _outer(beta_t, k_t * k_t)


def _start_states(k, v, beta, gate, m0, ibar0):
  """Start state of every chunk. k [C,N,B,H,K], v/beta [C,N,B,H,V], gate [C,N,B,H].

  Returns (m_starts, ibar_starts) [N,B,H,V,K] and the final (m, ibar) [B,H,V,K].
  """
  suffix = jax.lax.cumprod(gate, axis=0, reverse=True)  # prod_{s>=t}
  w = jnp.concatenate([suffix[1:], jnp.ones_like(suffix[:1])], axis=0)[..., None]
  dm = jnp.einsum("cnbhv,cnbhk->nbhvk", v * w, k, precision=_HIGHEST)
  dibar = jnp.einsum("cnbhv,cnbhk->nbhvk", beta * w, k * k, precision=_HIGHEST)
  return scan_chunk_states(suffix[0], dm, dibar, m0, ibar0)


def _walk(q, k, v, beta, gate, ip, m_starts, ibar_starts, return_variance):
  """Walks every chunk from its start state; outputs [C,N,B,H,V]."""

  def step(carry, x):
    q_t, k_t, v_t, beta_t, a_t = x
    m, ibar = _step(*carry, k_t, v_t, beta_t, a_t)
    return (m, ibar), readout(m, ibar, ip, q_t, return_variance)

  _, (out, var) = jax.lax.scan(step, (m_starts, ibar_starts), (q, k, v, beta, gate))
  return out, var


def _local_cotangents(m, ibar, ip, q_t, do_t, dvar_t):
  """Cotangents that step t's readout puts on its own state (M_t, Ibar_t), and dq_t.

  dvar_t is None when the variance was not returned.
  """
  r = 1.0 / (ibar + ip)
  mu = m * r
  dmu = _outer(do_t, q_t)
  dq = jnp.sum(do_t[..., :, None] * mu, axis=-2)
  d_prec = dmu * mu
  if dvar_t is not None:
    dq += 2.0 * q_t * jnp.sum(dvar_t[..., :, None] * r, axis=-2)
    d_prec += _outer(dvar_t, q_t * q_t) * r
  return dmu * r, -r * d_prec, dq


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _chunked_core(q, k, v, beta, gate, prior_precision, m0, ibar0, return_variance, group):
  out, _ = _chunked_fwd(q, k, v, beta, gate, prior_precision, m0, ibar0, return_variance, group)
  return out


def _chunked_fwd(q, k, v, beta, gate, prior_precision, m0, ibar0, return_variance, group):
  del group
  (m_starts, ibar_starts), (m_end, ibar_end) = _start_states(k, v, beta, gate, m0, ibar0)
  ip = prior_precision[:, None, None]
  out, var = _walk(q, k, v, beta, gate, ip, m_starts, ibar_starts, return_variance)
  residuals = (q, k, v, beta, gate, prior_precision, m_starts, ibar_starts)
  return (out, var, m_end, ibar_end), residuals


def _chunked_bwd(return_variance, group, residuals, cotangents):
  """Backward in three passes, parallel over chunks in the two walks.

  A. Every chunk walks forward from its start state and sums the cotangents its readouts put on
     its start state, sum_t (prod_{s<=t} a_s) * dS_t (the adjoint is linear in the state).
  B. A reverse scan over chunks adds the carry from later chunks: the cotangent of each chunk's
     end state and, at last, of the initial state.
  C. Chunks, `group` at a time, recompute their C states and walk the adjoint back from their
     end-state cotangent, giving the input gradients. Memory: group * C states.
  B and C run together, in one reverse scan over groups of chunks.
  """
  q, k, v, beta, gate, prior_precision, m_starts, ibar_starts = residuals
  d_out, d_var, d_m_end, d_ibar_end = cotangents
  if not return_variance:
    d_var = None
  ip = prior_precision[:, None, None]

  def own_cotangents(carry, x):  # pass A
    m, ibar, lam_m, lam_b, decay = carry
    q_t, k_t, v_t, beta_t, a_t, do_t, dvar_t = x
    m, ibar = _step(m, ibar, k_t, v_t, beta_t, a_t)
    decay = decay * a_t
    dm, dibar, _ = _local_cotangents(m, ibar, ip, q_t, do_t, dvar_t)
    w = decay[..., None, None]
    return (m, ibar, lam_m + w * dm, lam_b + w * dibar, decay), None

  zeros = jnp.zeros_like(m_starts)
  init = (m_starts, ibar_starts, zeros, zeros, jnp.ones_like(gate[0]))
  (_, _, own_m, own_b, decay), _ = jax.lax.scan(
      own_cotangents, init, (q, k, v, beta, gate, d_out, d_var))

  def group_gradients(carry, i):  # passes B and C for chunks [i * group, (i + 1) * group)
    take = lambda z, axis: jax.lax.dynamic_slice_in_dim(z, i * group, group, axis)
    xs = tuple(None if z is None else take(z, 1)
               for z in (q, k, v, beta, gate, d_out, d_var))
    m_g, ibar_g, own_m_g, own_b_g, decay_g = (
        take(z, 0) for z in (m_starts, ibar_starts, own_m, own_b, decay))

    def carry_back(lam, x):  # end-state cotangent of each chunk, last chunk first
      p, own_m_c, own_b_c = x
      p = p[..., None, None]
      return (p * lam[0] + own_m_c, p * lam[1] + own_b_c), lam

    carry, (lam_m, lam_b) = jax.lax.scan(carry_back, carry, (decay_g, own_m_g, own_b_g),
                                         reverse=True)

    def recompute(s, y):
      return _step(*s, *y), s

    _, (m_prev, ibar_prev) = jax.lax.scan(recompute, (m_g, ibar_g), xs[1:5])

    def adjoint(lam, y):
      lam_m, lam_b = lam
      q_t, k_t, v_t, beta_t, a_t, do_t, dvar_t, mp, ibp = y
      m, ibar = _step(mp, ibp, k_t, v_t, beta_t, a_t)
      dm, dibar, dq = _local_cotangents(m, ibar, ip, q_t, do_t, dvar_t)
      lam_m = lam_m + dm
      lam_b = lam_b + dibar
      dv = jnp.sum(lam_m * k_t[..., None, :], axis=-1)
      dbeta = jnp.sum(lam_b * (k_t * k_t)[..., None, :], axis=-1)
      dk = (jnp.sum(lam_m * v_t[..., :, None], axis=-2)
            + 2.0 * k_t * jnp.sum(lam_b * beta_t[..., :, None], axis=-2))
      da = jnp.sum(lam_m * mp + lam_b * ibp, axis=(-2, -1))
      dip = jnp.sum(dibar, axis=(-2, -1))
      a = a_t[..., None, None]
      return (a * lam_m, a * lam_b), (dq, dk, dv, dbeta, da, dip)

    _, grads = jax.lax.scan(adjoint, (lam_m, lam_b), xs + (m_prev, ibar_prev), reverse=True)
    return carry, grads

  n = q.shape[1]
  (d_m0, d_ibar0), grads = jax.lax.scan(group_gradients, (d_m_end, d_ibar_end),
                                        jnp.arange(n // group), reverse=True)

  def ungroup(z):  # [N/G, C, G, ...] -> [C, N, ...]
    z = jnp.moveaxis(z, 0, 1)
    return z.reshape((z.shape[0], n) + z.shape[3:])

  dq, dk, dv, dbeta, dgate, dip = map(ungroup, grads)
  d_prior = jnp.sum(dip, axis=(0, 1, 2))
  return dq, dk, dv, dbeta, dgate, d_prior, d_m0, d_ibar0


_chunked_core.defvjp(_chunked_fwd, _chunked_bwd)


def palimpsa_chunked(q, k, v, beta, gate, prior_precision, m0, ibar0, *, return_variance,
                     chunk_size):
  """Chunked Palimpsa for any T (padded with neutral steps a=1, k=v=beta=q=0, sliced back).

  Shapes as in linear_form.
  """
  b, t, h, _ = q.shape
  c = min(chunk_size, t)
  group = -(-t // (c * _BACKWARD_GROUPS))  # chunks per backward group
  n = -(-t // (c * group)) * group
  pad = n * c - t

  def to_chunks(x, fill):  # [B,T,H,...] -> [C,N,B,H,...]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    x = x.reshape((b, n, c) + x.shape[2:])
    return jnp.moveaxis(x, (0, 1, 2), (2, 1, 0))

  chunks = [to_chunks(x, 0.0) for x in (q, k, v, beta)] + [to_chunks(gate, 1.0)]
  out, var, m_end, ibar_end = _chunked_core(*chunks, prior_precision, m0, ibar0,
                                            return_variance, group)

  def from_chunks(x):  # [C,N,B,H,V] -> [B,T,H,V]
    x = jnp.moveaxis(x, (0, 1, 2), (2, 1, 0)).reshape((b, n * c, h) + x.shape[4:])
    return x[:, :t]

  return from_chunks(out), None if var is None else from_chunks(var), m_end, ibar_end

"""Chunkwise MesaNet: conjugate-gradient readout on chunk-start states.

Inside a chunk of C steps with start states H_0, G_0 and gamma_t = exp(L_t) (L_t the cumulative
log forget gate from the chunk start up to t), the per-step states are

    H_t = gamma_t H_0 + sum_{j<=t} W[t, j] k_j k_j^T,   W[t, j] = (gamma_t / gamma_j) beta_j,
    G_t = gamma_t G_0 + sum_{j<=t} W[t, j] v_j k_j^T,

so the matrix-vector product of step t's system with any vector y_t needs no per-step state:

    (H_t + diag lam) y_t = gamma_t H_0 y_t + sum_j W[t, j] (k_j . y_t) k_j + lam * y_t,

which is batched over all steps as gamma (Y H_0^T) + ((Y K^T) o W) K + lam Y. Conjugate gradients
run a fixed number of these products for every step at once, starting from the diagonal (Jacobi)
solve x0 = q / (diag H_t + lam); the readout is out_t = G_t x_t = gamma_t G_0 x_t +
((X K^T) o W) V. A lax.scan over chunks carries only (H, G) from one chunk start to the next.
Segment resets zero the decay across a segment start (see `palimpsa_jax.ops.common.chunk_masks`).
"""

import jax
from jax import lax
import jax.numpy as jnp

from palimpsa_jax.ops.common import chunk_masks, pad_time, to_chunks

_HIGHEST = lax.Precision.HIGHEST


def conjugate_gradient(matvec, rhs, x0, steps):
  """`steps` CG iterations for matvec(x) = rhs, batched over all leading axes of [..., K].

  Every system must be symmetric positive definite. Each system is scaled to a unit right-hand
  side, and a system stops (its x stays fixed) once its residual norm falls to the dtype's
  epsilon: past that point the iterations only move rounding noise, and their coefficients'
  derivatives (quotients of squared residuals) would overflow. Each iteration is rematerialised
  in the backward pass, so reverse mode stores only (x, r, p) per iteration.
  """
  dot = lambda a, b: jnp.sum(a * b, axis=-1, keepdims=True)
  norm2 = dot(rhs, rhs)
  nonzero = norm2 > 0
  scale = jnp.where(nonzero, jnp.sqrt(jnp.where(nonzero, norm2, 1.0)), 1.0)
  tiny = jnp.finfo(rhs.dtype).eps ** 2

  @jax.checkpoint
  def step(carry, _):
    x, r, p, rr = carry
    ap = matvec(p)
    active = rr > tiny
    pap = dot(p, ap)
    alpha = jnp.where(active, rr / jnp.where(active, pap, 1.0), 0.0)
    x = x + alpha * p
    r = r - alpha * ap
    rr_new = dot(r, r)
    p = r + jnp.where(active, rr_new / jnp.where(active, rr, 1.0), 0.0) * p
    return (x, r, p, rr_new), None

  x = x0 / scale
  r = rhs / scale - matvec(x)
  (x, *_), _ = lax.scan(step, (x, r, r, dot(r, r)), None, length=steps)
  return x * scale


def mesa_chunked(q, k, v, beta, log_gamma, lam, h0, g0, starts, chunk_size, cg_steps):
  """Chunked MesaNet with `cg_steps` CG iterations; arguments and results as `mesa_sequential`.

  Padding steps have q = k = v = beta = 0 and log_gamma = 0: they leave the states unchanged and
  read out zero.
  """
  batch, time, heads, _ = q.shape
  size = min(chunk_size, time)
  qc, kc, vc = (to_chunks(pad_time(x, size), size) for x in (q, k, v))  # [B, N, H, C, .]
  beta_c, log_g = (to_chunks(pad_time(x, size), size) for x in (beta, log_gamma))  # [B, N, H, C]
  start = pad_time(starts, size).reshape(batch, -1, size)  # [B, N, C]
  decay, from_start, to_end = chunk_masks(log_g, start)
  weights = decay * beta_c[..., None, :]  # W[t, j] = (gamma_t / gamma_j) beta_j, j <= t
  bk_end = (beta_c * to_end)[..., None] * kc

  def chunk_step(carry, xs):
    h, g = carry
    bk_end_c, k_c, v_c, chunk_decay = xs
    gate = chunk_decay[..., None, None]
    h_end = gate * h + jnp.einsum("bhci,bhcj->bhij", bk_end_c, k_c, precision=_HIGHEST)
    g_end = gate * g + jnp.einsum("bhcv,bhck->bhvk", v_c, bk_end_c, precision=_HIGHEST)
    return (h_end, g_end), (h, g)

  xs = (bk_end, kc, vc, from_start[..., -1])
  (h_last, g_last), (h_starts, g_starts) = lax.scan(
      chunk_step, (h0, g0), tuple(jnp.moveaxis(x, 1, 0) for x in xs))
  h_starts, g_starts = jnp.moveaxis(h_starts, 0, 1), jnp.moveaxis(g_starts, 0, 1)

  lam_c = lam[:, None, :]  # [H, 1, K]
  gamma = from_start[..., None]

  def matvec(y):  # y [B, N, H, C, K] -> (H_t + diag lam) y_t for every step t
    scores = jnp.einsum("bnhik,bnhjk->bnhij", y, kc, precision=_HIGHEST) * weights
    return (gamma * jnp.einsum("bnhij,bnhcj->bnhci", h_starts, y, precision=_HIGHEST)
            + jnp.einsum("bnhij,bnhjk->bnhik", scores, kc, precision=_HIGHEST) + lam_c * y)

  diagonal = (gamma * jnp.diagonal(h_starts, axis1=-2, axis2=-1)[..., None, :]
              + jnp.einsum("bnhij,bnhjk->bnhik", weights, kc * kc, precision=_HIGHEST))
  x = conjugate_gradient(matvec, qc, qc / (diagonal + lam_c), cg_steps)

  scores = jnp.einsum("bnhik,bnhjk->bnhij", x, kc, precision=_HIGHEST) * weights
  out = (gamma * jnp.einsum("bnhvk,bnhik->bnhiv", g_starts, x, precision=_HIGHEST)
         + jnp.einsum("bnhij,bnhjv->bnhiv", scores, vc, precision=_HIGHEST))
  out = jnp.moveaxis(out, 3, 2).reshape(batch, -1, heads, out.shape[-1])
  return out[:, :time], h_last, g_last

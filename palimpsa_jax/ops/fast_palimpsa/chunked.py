"""Fast Palimpsa with matmuls: every chunk at once, plain autodiff.

Layout inside: [B, N, H, C, ...] (N chunks of C steps). Everything the approximation reads
inside a chunk is a decay-weighted matmul over the chunk's steps: the two marginal precisions,
the reweighted local read (GLA-like) and the frozen carry read. Only the exact chunk-boundary
states need a scan over chunks, itself on matmul products:
M_end = P * M_start + (V * w)^T K,  Ibar_end = P * Ibar_start + (Beta * w)^T K^2.
Nothing of size T * V * K is formed, so autodiff stores O(N * V * K) states and needs no custom
VJP.
"""

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.common import chunk_masks, pad_time, to_chunks
from palimpsa_jax.ops.linear_form import scan_chunk_states

_HIGHEST = jax.lax.Precision.HIGHEST


def _boundary_states(k, v, beta, end_weight, chunk_decay, m0, ibar0):
  """Exact linear-form state entering every chunk [B,N,H,V,K], and after the last.

  k [B,N,H,C,K]; v, beta [B,N,H,C,V]; end_weight [B,N,H,C]; chunk_decay [B,N,H].
  """
  w = end_weight[..., None]
  dm = jnp.einsum("bnhcv,bnhck->nbhvk", v * w, k, precision=_HIGHEST)
  dibar = jnp.einsum("bnhcv,bnhck->nbhvk", beta * w, k * k, precision=_HIGHEST)
  starts, final = scan_chunk_states(jnp.moveaxis(chunk_decay, 1, 0), dm, dibar, m0, ibar0)
  return jax.tree.map(lambda s: jnp.moveaxis(s, 0, 1), starts), final


def fast_palimpsa_chunked(q, k, v, beta, log_alpha, starts, prior_precision, m0, ibar0, *,
                          return_variance, chunk_size):
  """Chunked Fast Palimpsa on float32 arrays, any T (padded with neutral steps, sliced back).

  q, k [B,T,H,K]; v, beta [B,T,H,V]; log_alpha [B,T,H]; starts [B,T] bool (segment
  restarts); prior_precision [H]; (m0, ibar0) [B,H,V,K] the linear-form state before step 0.
  Returns (out [B,T,H,V], variance or None, M_T, Ibar_T).
  """
  b, t, h, _ = q.shape
  c = chunk_size
  chunked = lambda x: to_chunks(pad_time(x, c), c)
  q, k, v, beta = map(chunked, (q, k, v, beta))
  log_alpha = chunked(log_alpha)  # [B,N,H,C]
  n = log_alpha.shape[1]
  decay, from_start, to_end = chunk_masks(log_alpha, pad_time(starts, c).reshape(b, n, c))

  (m_c, ibar_c), (m_end, ibar_end) = _boundary_states(k, v, beta, to_end, from_start[..., -1],
                                                      m0, ibar0)
  out, var = chunk_reads(q, k, v, beta, decay, from_start, m_c, ibar_c, prior_precision,
                         return_variance=return_variance, precision=_HIGHEST)

  def unchunk(y):  # [B,N,H,C,V] -> [B,T,H,V]
    return jnp.moveaxis(y, 3, 2).reshape(b, n * c, h, y.shape[-1])[:, :t]

  return unchunk(out), None if var is None else unchunk(var), m_end, ibar_end


def chunk_reads(q, k, v, beta, decay, from_start, m_c, ibar_c, prior_precision, *,
                return_variance: bool, precision):
  """(out, variance or None) [B,N,H,C,V] of every chunk from the exact state entering it.

  q, k [B,N,H,C,K]; v, beta [B,N,H,C,V]; decay, from_start as ops.common.chunk_masks';
  (m_c, ibar_c) [B,N,H,V,K] the linear-form state entering each chunk; prior_precision [H];
  all float32. precision: of the matmuls (the GPU implementation runs them on tensor cores).
  """
  ip = prior_precision[:, None]  # [H, 1]: broadcasts against [B,N,H,C] and [B,N,H,K]
  prec_c = ibar_c + ip[..., None]                           # [B,N,H,V,K]
  prec_k = jnp.mean(prec_c, axis=-2)                         # [B,N,H,K]
  prec_v = jnp.mean(prec_c, axis=-1)                         # [B,N,H,V]
  prec_s = jnp.mean(prec_c, axis=(-2, -1))[..., None]        # [B,N,H,1]

  ksq = k * k
  mm = lambda eq, x, y: jnp.einsum(eq, x, y, precision=precision)
  # Marginal precisions at every step: the start's marginal decayed, plus the collapsed writes.
  ib_k = (from_start[..., None] * (prec_k - ip)[..., None, :]
          + mm("bnhts,bnhsk->bnhtk", decay, jnp.mean(beta, -1, keepdims=True) * ksq)
          + ip[..., None])
  ib_v = (from_start[..., None] * (prec_v - ip)[..., None, :]
          + mm("bnhts,bnhsv->bnhtv", decay, beta * jnp.mean(ksq, -1, keepdims=True))
          + ip[..., None])
  ib_s = jnp.mean(ib_k, axis=-1, keepdims=True)              # [B,N,H,C,1]
  value_scale = ib_s / ib_v                                  # [B,N,H,C,V]

  scores = mm("bnhtk,bnhsk->bnhts", q / ib_k, k) * decay
  own = mm("bnhts,bnhsv->bnhtv", scores, v)
  mu_c = m_c / prec_c
  carried = mm("bnhvk,bnhtk->bnhtv", mu_c, q * prec_k[..., None, :] / ib_k)
  carried *= (from_start[..., None] * prec_v[..., None, :] / prec_s[..., None])
  out = (own + carried) * value_scale

  var = None
  if return_variance:
    var = jnp.sum(q * q / ib_k, axis=-1, keepdims=True) * value_scale
  return out, var

"""What Fast Palimpsa reads inside its chunks, every chunk at once, as matmuls.

Layout [B, N, H, C, ...] (N chunks of C steps). Given each chunk's exact entering state, the
two marginal precisions, the chunk's own reweighted (GLA-like) read and the read of the frozen
entering mean are decay-weighted C x C and C x K / K x V matmuls, independent across chunks:
XLA runs them as batched matmuls on the tensor cores (docs/fast_palimpsa.md has the math).
"""

import jax
import jax.numpy as jnp


def chunk_gates(log_alpha, starts):
  """Decays inside each chunk, restarts folded in (a restart acts as a zero gate).

  log_alpha: [B, N, H, C] float32; starts: [B, N, C] bool.
  Returns decay [B, N, H, C, C] (exp(G_t - G_s), s <= t in one segment, else 0),
  from_start [B, N, H, C] (exp(G_t) before the chunk's first restart, else 0) and to_end
  [B, N, H, C] (exp(G_C - G_s) for s in the chunk's last segment, else 0), with G_t the
  cumulative log-decay of the chunk up to step t.
  """
  cum = jnp.cumsum(log_alpha, axis=-1)
  seg = jnp.cumsum(starts.astype(jnp.int32), axis=-1)[:, :, None, :]  # [B, N, 1, C]
  size = log_alpha.shape[-1]
  same = jnp.tril(jnp.ones((size, size), bool)) & (seg[..., :, None] == seg[..., None, :])
  # exp only where the mask holds: elsewhere G_t - G_s may overflow, and a where around an
  # inf would give NaN gradients.
  decay = jnp.where(same, jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], 0.0)),
                    0.0)
  from_start = jnp.where(seg == 0, jnp.exp(cum), 0.0)
  last = seg == seg[..., -1:]
  to_end = jnp.where(last, jnp.exp(jnp.where(last, cum[..., -1:] - cum, 0.0)), 0.0)
  return decay, from_start, to_end


def chunk_reads(q, k, v, beta, decay, from_start, m_c, ibar_c, prior_precision, *,
                return_variance: bool, precision):
  """(out, variance or None) [B, N, H, C, V] of every chunk from its entering state.

  q, k [B, N, H, C, K]; v, beta [B, N, H, C, V]; decay, from_start as `chunk_gates`';
  (m_c, ibar_c) [B, N, H, V, K] the exact linear-form state entering each chunk;
  prior_precision [H]; all float32. precision: of the matmuls.
  """
  mm = lambda eq, x, y: jnp.einsum(eq, x, y, precision=precision)
  ip = prior_precision[:, None]  # [H, 1]
  prec_c = ibar_c + ip[..., None]
  prec_k = jnp.mean(prec_c, axis=-2)                      # [B, N, H, K]
  prec_v = jnp.mean(prec_c, axis=-1)                      # [B, N, H, V]
  prec_s = jnp.mean(prec_c, axis=(-2, -1))[..., None]     # [B, N, H, 1]
  ksq = k * k
  # The marginal precisions at every step: the entering marginal decayed, plus the
  # chunk's writes collapsed over the other axis.
  ib_k = (from_start[..., None] * (prec_k - ip)[..., None, :]
          + mm("bnhts,bnhsk->bnhtk", decay, jnp.mean(beta, -1, keepdims=True) * ksq)
          + ip[..., None])
  ib_v = (from_start[..., None] * (prec_v - ip)[..., None, :]
          + mm("bnhts,bnhsv->bnhtv", decay, beta * jnp.mean(ksq, -1, keepdims=True))
          + ip[..., None])
  ib_s = jnp.mean(ib_k, axis=-1, keepdims=True)            # [B, N, H, C, 1]
  value_scale = ib_s / ib_v
  own = mm("bnhts,bnhsv->bnhtv", mm("bnhtk,bnhsk->bnhts", q / ib_k, k) * decay, v)
  carried = mm("bnhvk,bnhtk->bnhtv", m_c / prec_c, q * prec_k[..., None, :] / ib_k)
  carried *= from_start[..., None] * prec_v[..., None, :] / prec_s[..., None]
  out = (own + carried) * value_scale
  var = None
  if return_variance:
    var = jnp.sum(q * q / ib_k, axis=-1, keepdims=True) * value_scale
  return out, var

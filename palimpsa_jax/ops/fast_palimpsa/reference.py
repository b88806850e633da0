"""Fast Palimpsa stated literally: a loop over chunks, and over the steps of each chunk.

The test oracle of the approximation (docs/fast_palimpsa.md). Runs in the dtype it is given
(tests call it in float64 inside `jax.enable_x64(True)`) and carries, step by step, everything
the approximation reads: the exact state (mu, I), the frozen state the chunk started from, the
chunk's own writes and the two marginal precisions.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.palimpsa_contract import PalimpsaResult, PalimpsaState


class ChunkStart(NamedTuple):
  """What a chunk reads from the exact state it starts from, [B, H, ...]."""

  mu: jax.Array         # [B,H,V,K] frozen mean mu_c = M_c / I_c
  prec_k: jax.Array     # [B,H,K] mean over V of I_c
  prec_v: jax.Array     # [B,H,V] mean over K of I_c
  prec_s: jax.Array     # [B,H] mean of I_c


class InChunk(NamedTuple):
  """What the approximation carries from step to step inside a chunk."""

  mu: jax.Array         # [B,H,V,K] exact mean (becomes the next chunk's start)
  precision: jax.Array  # [B,H,V,K] exact precision
  local: jax.Array      # [B,H,V,K] the chunk's own writes, sum_s exp(g_t - g_s) v_s k_s^T
  dev_k: jax.Array      # [B,H,K] Ibar_K - Ip
  dev_v: jax.Array      # [B,H,V] Ibar_V - Ip
  decay: jax.Array      # [B,H] exp(g_t): how much of the chunk start reaches step t


def chunk_start(mu, precision, ip) -> tuple[ChunkStart, InChunk]:
  """The frozen start of a chunk and the step carry before its first step; ip [1,H,1,1]."""
  start = ChunkStart(mu, jnp.mean(precision, axis=-2), jnp.mean(precision, axis=-1),
                     jnp.mean(precision, axis=(-2, -1)))
  carry = InChunk(mu, precision, jnp.zeros_like(mu), start.prec_k - ip[..., 0],
                  start.prec_v - ip[..., 0, :], jnp.ones_like(start.prec_s))
  return start, carry


def step(start: ChunkStart, carry: InChunk, q_t, k_t, v_t, beta_t, a_t, ip):
  """One step of the approximation: (new carry, (out [B,H,V], variance [B,H,V])).

  q_t, k_t [B,H,K]; v_t, beta_t [B,H,V]; a_t [B,H] the gate (0 where a segment restarts);
  ip [1,H,1,1].
  """
  a = a_t[..., None, None]
  ksq = k_t * k_t
  precision = a * carry.precision + (1 - a) * ip + beta_t[..., :, None] * ksq[..., None, :]
  write = v_t[..., :, None] * k_t[..., None, :]
  mu = a * (carry.precision / precision) * carry.mu + write / precision
  local = a * carry.local + write
  dev_k = a[..., 0] * carry.dev_k + jnp.mean(beta_t, axis=-1, keepdims=True) * ksq
  dev_v = a[..., 0] * carry.dev_v + beta_t * jnp.mean(ksq, axis=-1, keepdims=True)
  decay = a_t * carry.decay
  ib_k = dev_k + ip[..., 0]
  ib_v = dev_v + ip[..., 0, :]
  ib_s = jnp.mean(ib_k, axis=-1, keepdims=True)
  own = jnp.einsum("bhvk,bhk->bhv", local, q_t / ib_k) * ib_s / ib_v
  carried = jnp.einsum("bhvk,bhk->bhv", start.mu, q_t * start.prec_k / ib_k)
  carried *= (decay[..., None] * start.prec_v / ib_v) * (ib_s / start.prec_s[..., None])
  var = jnp.sum(q_t * q_t / ib_k, axis=-1, keepdims=True) * ib_s / ib_v
  return InChunk(mu, precision, local, dev_k, dev_v, decay), (own + carried, var)


def reference_fast_palimpsa(q, k, v, beta, log_alpha, prior_precision, *, initial_state=None,
                            segment_ids=None, chunk_size=16) -> PalimpsaResult:
  """Literal Fast Palimpsa. q, k [B,T,H,K]; v, beta [B,T,H,V]; log_alpha [B,T,H]; prior [H].

  Chunks start at steps 0, C, 2C, ... of the call; where the segment id changes the gate is 0,
  which restarts the exact state and the marginals from the prior and cuts the chunk's earlier
  writes and its start state off. beta=None means beta == 0. Returns out and variance
  [B,T,H,V] and the exact state [B,H,V,K] after the last step, in the dtype of the inputs.
  """
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  if beta is None:
    beta = jnp.zeros_like(v)
  ip = prior_precision[None, :, None, None]
  if initial_state is None:
    mu0 = jnp.zeros((b, h, vd, kd), v.dtype)
    prec0 = jnp.broadcast_to(ip, (b, h, vd, kd)).astype(v.dtype)
  else:
    mu0, prec0 = initial_state
  gate = jnp.exp(log_alpha)
  if segment_ids is not None:
    starts = jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)))
    gate = jnp.where(starts[:, :, None], 0.0, gate)
  c = chunk_size
  n = -(-t // c)
  pad = n * c - t

  def chunks(x, fill=0.0):  # [B,T,H,...] -> [N,C,B,H,...], padded with neutral steps
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape((b, n, c) + x.shape[2:]), (0, 1, 2), (2, 0, 1))

  def one_chunk(state, xs):
    start, carry = chunk_start(*state, ip)
    carry, ys = jax.lax.scan(lambda s, x: step(start, s, *x, ip), carry, xs)
    return (carry.mu, carry.precision), ys

  xs = tuple(chunks(x) for x in (q, k, v, beta)) + (chunks(gate, 1.0),)
  (mu, prec), (out, var) = jax.lax.scan(one_chunk, (mu0, prec0), xs)
  from_chunks = lambda y: jnp.moveaxis(y, (0, 1, 2), (1, 2, 0)).reshape((b, n * c, h, vd))[:, :t]
  return PalimpsaResult(from_chunks(out), from_chunks(var), PalimpsaState(mu, prec))

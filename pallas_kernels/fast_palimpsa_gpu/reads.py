"""Fast Palimpsa's chunk reads on the fused Mosaic GPU kernels, and the XLA parts around them.

`step_gates` and `step_rows` turn the gates and segment restarts into the per-step rows the
kernels read; `chunk_start_terms` and `weighted_mean` turn the exact states entering the
chunks into what the reads need of them (two marginals and the weighted mean N);
`fused_reads` runs the forward kernel (reads_forward.py) with a custom VJP on the backward
kernel (reads_backward.py) and N's own VJP (dN, the backward kernel's one state-sized
output, becomes the states' cotangents there). Everything else (the states, these XLA
parts) is differentiated by JAX.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import round_up
from pallas_kernels.fast_palimpsa_gpu import reads_backward, reads_forward
from pallas_kernels.fast_palimpsa_gpu.tiles import (ROW_CS, ROW_F, ROW_G, ROW_ID, ROW_IP,
                                                    ROW_MB, NUM_ROWS, BackwardTiles,
                                                    ForwardTiles, padded_width)
from pallas_kernels.palimpsa_gpu.mosaic_tiles import SMEM_LIMIT

f32, bf16 = jnp.float32, jnp.bfloat16


def step_gates(log_alpha, starts, chunk: int):
  """The chunk gates of every step, without the [C, C] decay matrix.

  log_alpha: [B, Tp, H]; starts: [B, Tp] bool (Tp a multiple of chunk).
  Returns (g, ids, from_start, to_end) [B, Tp, H] float32: g the cumulative log-decay
  from the chunk's start up to each step; ids equal for two steps of one segment of one
  chunk and different for steps of different segments or of neighbouring chunks (a CTA
  compares the ids of at most 4 consecutive chunks; ops.common.chunk_masks' masks: the
  decay exp(g_t - g_s) holds between steps of equal id); from_start = exp(g) before any
  restart in the chunk, else 0; to_end = exp(g_C - g) in the chunk's last segment, else 0.
  """
  b, tp, h = log_alpha.shape
  n = tp // chunk
  la = log_alpha.astype(f32).reshape(b, n, chunk, h)
  g = jnp.cumsum(la, axis=2)
  seg = jnp.cumsum(starts.reshape(b, n, chunk).astype(jnp.int32), axis=2)[..., None]
  from_start = jnp.where(seg == 0, jnp.exp(g), 0.0)
  last = seg == seg[:, :, -1:]
  to_end = jnp.where(last, jnp.exp(jnp.where(last, g[:, :, -1:] - g, 0.0)), 0.0)
  # Small integers, exact in float32: the chunk's index modulo 8, then the segment in it.
  ids = (jnp.arange(n) % 8 * (chunk + 1))[None, :, None, None] + seg
  steps = lambda x: jnp.broadcast_to(x, (b, n, chunk, h)).reshape(b, tp, h).astype(f32)
  return steps(g), steps(ids), steps(from_start), steps(to_end)


def chunk_start_terms(m_c, b_c, ip, k_true: int, v_true: int):
  """The marginals the reads need of the linear-form states (M_c, Ibar_c) entering the chunks.

  m_c, b_c: [BH, NC, Vp, Kp] float32 (zero padding); ip: [BH] the prior precision.
  Returns bk = mean_v Ibar_c [BH, NC, Kp], bv = mean_k Ibar_c [BH, NC, Vp] and ps =
  mean(Ibar_c + Ip) [BH, NC] (means over the true K and V).
  """
  bk = jnp.sum(b_c, axis=-2) / v_true
  bv = jnp.sum(b_c, axis=-1) / k_true
  ps = jnp.sum(bk, axis=-1) / k_true + ip[:, None]
  return bk, bv, ps


def weighted_mean(m_c, b_c, bk, bv, ip):
  """N = mu_c * (bv + Ip) (x) (bk + Ip) [BH, NC, Vp, Kp], mu_c = M_c / (Ibar_c + Ip): the
  carried read is (f / ps) (q / ibk) @ N^T. Shapes as `chunk_start_terms`'."""
  ipb = ip[:, None, None, None]
  return m_c / (b_c + ipb) * (bv[..., :, None] + ipb) * (bk[..., None, :] + ipb)


def step_rows(g, ids, from_start, ps, ip, mean_beta, rows: int, chunk: int):
  """[BH, Tp / rows, NUM_ROWS, rows] float32: the rows of `tiles.py` (ROW_*).

  g, ids, from_start, mean_beta: [B, Tp, H]; ps: [BH, NC]; ip: [H].
  """
  b, tp, h = g.shape
  head_major = lambda x: jnp.moveaxis(x, 2, 1).reshape(b * h, tp)
  cs = head_major(from_start) / jnp.repeat(ps, chunk, axis=1)
  ip_rows = jnp.broadcast_to(jnp.tile(ip, b)[:, None], (b * h, tp))
  by_index = {ROW_G: head_major(g), ROW_ID: head_major(ids), ROW_F: head_major(from_start),
              ROW_CS: cs, ROW_IP: ip_rows, ROW_MB: head_major(mean_beta)}
  stacked = jnp.stack([by_index[i] for i in range(NUM_ROWS)], axis=1)  # [BH, NUM_ROWS, Tp]
  return jnp.moveaxis(stacked.reshape(b * h, NUM_ROWS, tp // rows, rows), 2, 1)


def padded(x, width: int | None = None):
  """[BH, NC, D] -> [BH, NC, width] (default `padded_width(D)`), zero padding."""
  width = padded_width(x.shape[-1]) if width is None else width
  return jnp.pad(x, ((0, 0), (0, 0), (0, width - x.shape[-1])))


@dataclasses.dataclass(frozen=True)
class ReadsCall:
  """The static part of a `fused_reads` call."""

  heads: int
  chunk: int
  k_true: int  # K before padding: the means over K.
  with_var: bool
  forward: ForwardTiles
  backward: BackwardTiles
  interpret: object = False  # False, True or plgpu.InterpretGPUParams.


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def fused_reads(q, k, v, beta, rows, bk, bv, m_c, b_c, ip, call: ReadsCall):
  """(out [B, Tp, H, Vp] v's dtype, variance float32 or None) of every chunk.

  q, k [B, Tp, H, Kp], v, beta [B, Tp, H, Vp] bfloat16 (Tp a multiple of the tiles' rows);
  rows: `step_rows`; bk [BH, NC, Kp], bv [BH, NC, Vp]: `chunk_start_terms`; m_c, b_c
  [BH, NC, Vp, Kp] float32: the states entering the chunks; ip [BH]. The kernels read
  `weighted_mean` in bfloat16, computed here in each direction: the states are residuals
  of their own VJP already, N would be a new one.
  """
  n_c = weighted_mean(m_c, b_c, bk, bv, ip).astype(bf16)
  return reads_forward.chunk_reads_forward(
      q, k, v, beta, rows, padded(bk), padded(bv, call.forward.v_span(bv.shape[-1])), n_c,
      heads=call.heads, chunk=call.chunk, k_true=call.k_true, with_var=call.with_var,
      tiles=call.forward, interpret=call.interpret)


def _fused_reads_fwd(q, k, v, beta, rows, bk, bv, m_c, b_c, ip, call):
  residuals = (q, k, v, beta, rows, bk, bv, m_c, b_c, ip)
  return fused_reads(*residuals, call), residuals


def _fused_reads_bwd(call, residuals, cotangents):
  q, k, v, beta, rows, bk, bv, m_c, b_c, ip = residuals
  dout, dvar = cotangents
  kp, vp = bk.shape[-1], bv.shape[-1]
  n_c, n_vjp = jax.vjp(weighted_mean, m_c, b_c, bk, bv, ip)
  dq, dk, dv, dbeta, d_rows, dbk, dbv, dn = reads_backward.chunk_reads_backward(
      q, k, v, beta, rows, padded(bk, call.backward.k_span(kp)),
      padded(bv, call.backward.v_span(vp)), n_c.astype(bf16),
      dout.astype(v.dtype), dvar if call.with_var else None, heads=call.heads,
      chunk=call.chunk, k_true=call.k_true, tiles=call.backward, interpret=call.interpret)
  dm, db, dbk_n, dbv_n, dip = n_vjp(dn)
  return (dq, dk, dv, dbeta, d_rows, dbk[..., :kp] + dbk_n, dbv[..., :vp] + dbv_n, dm, db,
          dip)


fused_reads.defvjp(_fused_reads_fwd, _fused_reads_bwd)


# Tuned tiles by (chunk, Kp, Vp): (forward sub, num_sub, backward sub, slots), the best rows of
# benchmarks/records/fast_palimpsa_tuning_2026-12-06T0959.json (benchmarks/op/tuning.py, one
# H100, every perf shape at chunks 64 and 32, without the variance). Either part is kept only
# where it fits with the call's variance; what has no tuned fitting entry takes the provisional
# rule of `default_tiles`.
TUNED: dict[tuple[int, int, int], tuple[int, ...]] = {
    (64, 96, 192): (64, 3, 64, 1),
    (64, 48, 48): (48, 1, 64, 2),
    (64, 128, 128): (64, 1, 64, 2),
    (64, 16, 32): (32, 1, 64, 2),
    (32, 96, 192): (64, 3, 64, 2),
    (32, 48, 48): (48, 1, 64, 1),
    (32, 128, 128): (64, 2, 64, 1),
    (32, 16, 32): (32, 1, 64, 1),
}


def default_k_sub(kp: int) -> int:
  """The K-side backward kernel's K-block: all of Kp up to 64, else the widest power of two
  up to 64 dividing it (the operands' swizzle is the widest dividing every width)."""
  return kp if kp <= 64 else max(w for w in (16, 32, 64) if kp % w == 0)


def default_v_sub(vp: int) -> int:
  """The V-side backward kernel's sub-tile: all of Vp up to 64, else the widest of 64, 48,
  32 and 16 that divides it."""
  return vp if vp <= 64 else max(w for w in (16, 32, 48, 64) if vp % w == 0)


def fits(tiles, kp: int, vp: int, with_var: bool) -> bool:
  """Whether both directions' CTAs fit in shared memory with these tiles."""
  forward, backward = tiles
  return (reads_forward.smem_bytes(forward, kp, vp, jnp.bfloat16, with_var) <= SMEM_LIMIT
          and reads_backward.smem_bytes(backward, kp, vp, with_var) <= SMEM_LIMIT)


def default_tiles(chunk: int, kp: int, vp: int, with_var: bool):
  """(ForwardTiles, BackwardTiles) for a call: each direction's tuned entry where it fits,
  else a provisional rule (not measured yet): forward V-blocks of one sub-tile of up to 64
  columns (more CTAs, and [rows, 64] accumulators that leave registers for the rest);
  backward V sub-tiles of `default_v_sub` through a ring of two slots where it fits in
  shared memory, else one. The backward's K-blocks are `default_k_sub`'s."""
  tuned = TUNED.get((chunk, kp, vp), ())
  k_sub = default_k_sub(kp)
  backwards = [BackwardTiles(chunk, *tuned[2:], k_sub)] if tuned[2:] else []
  backwards += [BackwardTiles(chunk, default_v_sub(vp), slots, k_sub) for slots in (2, 1)]
  backward = next((t for t in backwards
                   if reads_backward.smem_bytes(t, kp, vp, with_var) <= SMEM_LIMIT),
                  backwards[-1])
  forward = ForwardTiles(chunk, *tuned[:2]) if tuned else None
  if forward is None or reads_forward.smem_bytes(forward, kp, vp, jnp.bfloat16,
                                                 with_var) > SMEM_LIMIT:
    forward = ForwardTiles(chunk, min(vp, 64))
  return forward, backward


def reads_call(q, k, v, beta, *, chunk: int, with_var: bool, interpret,
               tiles=None) -> ReadsCall:
  """The static part of `fused_reads` for arrays of these shapes [B, T, H, D] (unpadded).

  tiles: (ForwardTiles, BackwardTiles), default `default_tiles`.
  Raises:
    NotImplementedError: the fused kernels cannot take the call; the message says why.
  """
  dtypes = {jnp.dtype(x.dtype).name for x in (q, k, v, beta)}
  if dtypes != {"bfloat16"}:
    raise NotImplementedError(
        f"the fused chunk-read kernels take bfloat16 q, k, v and beta (their tensor-core "
        f"operands are bfloat16, short of float32's accuracy); this call has "
        f"{', '.join(sorted(dtypes))}")
  if chunk not in (16, 32, 64, 128):
    raise NotImplementedError(f"the fused chunk-read kernels take chunks of 16, 32, 64 or "
                              f"128 steps, not {chunk}")
  heads, kd, vd = q.shape[2], q.shape[-1], v.shape[-1]
  kp, vp = round_up(kd, 16), round_up(vd, 16)
  if max(kp, vp) > 256:
    raise NotImplementedError(f"the fused chunk-read kernels take K and V up to 256, not "
                              f"K={kd}, V={vd}")
  forward, backward = tiles or default_tiles(chunk, kp, vp, with_var)
  if ((forward.chunk, backward.chunk) != (chunk, chunk) or forward.sub % 16
      or backward.sub % 16 or backward.k_sub % 16 or backward.slots < 1
      or (vp % backward.sub and backward.sub < vp)
      or max(forward.v_span(vp), backward.v_span(vp)) > 256):
    raise NotImplementedError(f"tiles {forward}, {backward} do not fit chunk={chunk}, "
                              f"V={vd}")
  if not interpret:
    used = (reads_forward.smem_bytes(forward, kp, vp, v.dtype, with_var),
            reads_backward.smem_bytes(backward, kp, vp, with_var))
    if max(used) > SMEM_LIMIT:
      raise NotImplementedError(
          f"the fused chunk-read kernels need {used[0] // 1024} KiB (forward) and "
          f"{used[1] // 1024} KiB (backward) of shared memory at chunk={chunk}, K={kd}, "
          f"V={vd} with {forward}, {backward}; a CTA has {SMEM_LIMIT // 1024}")
  return ReadsCall(heads, chunk, kd, with_var, forward, backward, interpret)

"""Fast Palimpsa's chunk reads, backward, as two Pallas Mosaic GPU kernels (Hopper, wgmma).

The mirror of reads_forward.py, split along what each gradient needs so that no CTA holds
more than a few accumulators (one kernel holding all of them spilled registers at the
large heads): the V-side kernel (reads_backward_v.py) walks V in sub-tiles and writes dv,
dbeta, dbv and dZ; the K-side kernel (reads_backward_k.py) takes K in blocks and writes
dq, dk, dbk and dN. Both recompute what they need of the forward (D, ibk, qk; the V-side
also W, Av, ibv, own and the carried read Rc; the K-side dS from dZ and v). No float32
intermediate of the reads goes through device memory: dZ travels in bfloat16 (a bfloat16
wgmma operand either way), and dN [V, K] per chunk is the one state-sized output (it
becomes the state adjoints the carries kernel walks).

The gradients, by hand (forward as in reads_forward.py; Z = own + cs Rc, vs = ibs / ibv,
out = Z vs, variance = sigma vs with sigma = sum_k q qk; sums over the true K and V):

    V-side, per V sub-tile:
    dZ = dout vs                     dvs = dout Z + dvar sigma
    dsigma = sum_v dvar vs           dibs = sum_v dvs / ibv
    dibv = -dvs vs / ibv             (dAv = dibv)
    dcs = sum_v dZ Rc                df += sum_v dibv bv            dIp += sum_v dibv
    dbv = sum_t f dibv (per chunk)
    dv = W^T @ dZ                    dY = D^T @ dAv,  dbeta = dY mk,  dmk = sum_v dY beta
    K-side, per K block:
    dS = (dZ @ v^T) D                                              (dW = dZ @ v^T)
    dqk = dS @ k + cs (dZ @ N) + dsigma q                          (N of the row's chunk)
    dN = dZ^T @ (cs qk) (per chunk)
    dq = dqk / ibk + dsigma qk,  dibk = -dqk qk / ibk + dibs / K   (dAk = dibk)
    df += sum_k dibk bk,  dIp += sum_k dibk,  dbk = sum_t f dibk (per chunk)
    dk = dS^T @ qk + 2 k (dX mb + dmk / K),  dX = D^T @ dAk,  dmb = sum_k dX k^2

(Y = beta mk, X = mb k^2, S = qk @ k^T, W = S D.) The decays' cotangent: with dD =
dAv @ Y^T + dW S + dAk @ X^T and P = dD D, dg_t = sum_s P[t, s] - sum_s P[s, t]. No CTA
forms dD: since Av = D @ Y, own = W @ v and Ak = D @ X, those sums are per-step sums

    sum_s P[t, s] = sum_v (dAv Av + dZ own)[t] + sum_k (dAk Ak)[t]
    sum_s P[s, t] = sum_v (Y dY + v dv)[t] + sum_k (X dX)[t]

which each kernel writes for XLA to combine. The per-chunk sums over steps (dbv, dbk) are
wgmmas too (`reads_backward_v.chunk_sums_selector`). Every product runs on the tensor
cores with bfloat16 operands read from shared memory (the transposes are views), float32
accumulators.
"""

import jax.numpy as jnp

from pallas_kernels.fast_palimpsa_gpu import reads_backward_k, reads_backward_v
from pallas_kernels.fast_palimpsa_gpu.reads_backward_k import (KROW_F, KROW_G_COLS,
                                                               KROW_G_ROWS, KROW_IP, KROW_MB)
from pallas_kernels.fast_palimpsa_gpu.reads_backward_v import (VROW_CS, VROW_F, VROW_G_COLS,
                                                               VROW_G_ROWS, VROW_IP)
from pallas_kernels.fast_palimpsa_gpu.tiles import (ROW_CS, ROW_F, ROW_G, ROW_IP, ROW_MB,
                                                    NUM_ROWS, BackwardTiles)


def smem_bytes(t: BackwardTiles, kp: int, vp: int, with_var: bool) -> int:
  """Shared memory of the larger of the two kernels' CTAs."""
  return max(reads_backward_v.smem_bytes(t, kp, vp, with_var),
             reads_backward_k.smem_bytes(t, kp, vp))


def chunk_reads_backward(q, k, v, beta, rows, bk, bv, n_c, dout, dvar, *, heads: int,
                         chunk: int, k_true: int, tiles: BackwardTiles, interpret):
  """The cotangents of `reads_forward.chunk_reads_forward`'s inputs.

  Arguments as there (bk [BH, NC, tiles.k_span(Kp)], bv [BH, NC, tiles.v_span(Vp)]),
  and dout [B, Tp, H, Vp] (v's dtype), dvar [B, Tp, H, Vp] float32 or None (no variance).
  Returns dq, dk [B, Tp, H, Kp], dv, dbeta [B, Tp, H, Vp] (the rows' dtype), drows
  [BH, NB, NUM_ROWS, R] (the rows' cotangent; none for the segment ids), dbk [BH, NC, k_span],
  dbv [BH, NC, span], dn [BH, NC, Vp, Kp] (float32).
  """
  common = dict(heads=heads, chunk=chunk, k_true=k_true, tiles=tiles, interpret=interpret)
  dv, dbeta, dz, vrows, dbv = reads_backward_v.backward_v(
      q, k, v, beta, rows, bk, bv, n_c, dout, dvar, **common)
  dq, dk, krows, dbk, dn = reads_backward_k.backward_k(
      q, k, v, rows, bk, dz, vrows, n_c, with_var=dvar is not None, **common)
  krows = jnp.sum(krows, axis=2)
  vr, kr = (lambda i: vrows[:, :, i]), (lambda i: krows[:, :, i])
  by_index = {ROW_G: vr(VROW_G_ROWS) + kr(KROW_G_ROWS) - vr(VROW_G_COLS) - kr(KROW_G_COLS),
              ROW_F: vr(VROW_F) + kr(KROW_F), ROW_CS: vr(VROW_CS),
              ROW_IP: vr(VROW_IP) + kr(KROW_IP), ROW_MB: kr(KROW_MB)}
  zero = jnp.zeros_like(vr(0))
  drows = jnp.stack([by_index.get(i, zero) for i in range(NUM_ROWS)], axis=2)
  return dq, dk, dv, dbeta, drows, dbk, dbv, dn

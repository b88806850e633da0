"""Exact Palimpsa on NVIDIA GPUs: chunk-boundary matmuls + Pallas chunk walks.

Forward: (1) one Pallas kernel per (batch*head, V-tile, K-part, M or Ibar) adds each
chunk's write to the linear state (M = mu*I, Ibar = I - Ip) as tensor-core matmuls,
sequentially over chunks, giving the boundary states (saved for the backward); (2) a
Pallas kernel over (batch*head, chunk, V-tile) walks the chunk's steps, dividing and
reading out at every step. Both read the inputs in the caller's [B, T, H, D] layout.
Backward: recompute sub-chunk states and walk each chunk in reverse (Pallas, one
[16, 16] state tile per Triton program or per warp of a Mosaic GPU warpgroup, the tiles'
sums added by TMA reduce-add or by XLA) with zero adjoint from later chunks, scan the
adjoint carries over chunks (Pallas), add the carries' contributions as matmuls (XLA);
dlog_alpha from the identity
dL/dlog a_t = sum_{u >= t, same segment} (<dM_u^loc, M_u> + <dI_u^loc, Ibar_u>
                                          - v_u . dv_u - beta_u . dbeta_u).
"""

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp

from pallas_kernels.common import (largest_power_of_two_dividing, next_power_of_two,
                                   round_up)
from pallas_kernels.palimpsa_gpu import boundary, layout, walk, walk_mosaic

_MAX_DIM = 256
_DIM_MULTIPLE = 16  # K and V are padded to multiples of 16 (tensor-core tiles).


@dataclasses.dataclass(frozen=True)
class Config:
  """Static configuration of one call.

  K is stored padded to Kp, a multiple of 16. Each stage walks K in equal power-of-two
  parts (Triton tensors have power-of-two shapes): the forward walk in parts of k_part
  columns over Kp; the boundary kernel pads K further, to a multiple of k_part_boundary,
  and the backward walk to a multiple of k_part_bwd * k_split_bwd (k_split_bwd programs
  over slices of parts; one part over all of K when k_part_bwd is a power of two >= Kp).
  """

  b: int
  t: int
  h: int
  k: int
  v: int
  chunk: int
  block_v: int
  block_v_bwd: int
  block_v_boundary: int
  k_part: int
  k_part_boundary: int
  k_part_bwd: int
  unroll: int
  sub: int
  groups_bwd: int
  return_variance: bool
  log_alpha_dtype: str
  prior_dtype: str
  interpret: bool
  num_warps: int = 4
  num_warps_bwd: int = 1
  num_warps_boundary: int = 4
  # Boundary kernel: Triton software pipelining of its chunk loop. Forward walk: loop
  # bodies ahead that its rows are loaded. 3 stages and 2 bodies were no faster (run 12).
  num_stages_boundary: int = 2
  # Boundary kernel: M and Ibar in separate programs; with bfloat16 v and beta, chunk
  # writes as exact bfloat16 tensor-core products instead of 3xTF32 (run 14: 1.7-2.5x).
  split_boundary: bool = True
  boundary_bf16: bool = True
  # The forward kernels read q, k, v, beta in the caller's layout [B, T, H, D] instead
  # of head-major copies (run 14: forward 1.03-1.28x, fwd+bwd within 1%).
  caller_rows: bool = True
  prefetch: int = 1
  # Backward walk: K-slices in separate programs (partial dv, dbeta, s summed by XLA),
  # each reverse body loading the next sub-chunk's rows first (run 16).
  k_split_bwd: int = 1
  prefetch_bwd: bool = False
  # Backward walk calls are cut by batch*head so that each call's checkpoint scratch
  # and partial sums take at most this many bytes (D760: 14.5 GB in one call, run 16).
  max_walk_temp_bytes: int = 2 << 30
  # Backward walk: "mosaic" (walk_mosaic: Hopper and newer, rows that fit shared memory)
  # or "triton" (walk.walk_backward, with the tiles above).
  walk_bwd: str = "triton"
  # Mosaic walk: the tiles' sums added by TMA reduce-add into one array each instead of
  # partial sums that XLA adds (compiled only; the order of the additions varies run to
  # run, by float32 rounding; off under --xla_gpu_deterministic_ops, run 19: 1.05-1.13x).
  accumulate_bwd: bool = False

  @property
  def row_heads(self) -> int | None:
    """`heads` of the forward kernels' row BlockSpecs: H for the caller's layout."""
    return self.h if self.caller_rows else None

  @property
  def t_pad(self) -> int:
    return round_up(self.t, self.chunk) - self.t

  @property
  def walk_pieces(self) -> int:
    """Backward walk calls: the fewest dividing B*H within max_walk_temp_bytes."""
    bh, tp, vp, kp = self.b * self.h, self.t + self.t_pad, self.v + self.v_pad, self.k_bwd
    if self.walk_bwd == "mosaic":  # No scratch; the sums and the broadcast gates.
      nv, nk = vp // walk_mosaic.TILE, kp // walk_mosaic.TILE
      pv, pk = (1, 1) if self.accumulate_bwd else (nv, nk)
      per_head = 4 * tp * (pv * kp * 2 + pk * vp * 2 + pk * pv + walk_mosaic.TILE)
    else:
      scratch = tp // self.sub * self.groups_bwd * self.block_v_bwd * kp * 2
      partials = (self.groups_bwd * kp * 2 + self.k_split_bwd * vp * 2 + 1) * tp
      per_head = 4 * (scratch + partials)
    pieces = 1
    while pieces < bh and (bh % pieces or per_head * bh // pieces > self.max_walk_temp_bytes):
      pieces += 1
    return pieces

  @property
  def k_pad(self) -> int:
    return round_up(self.k, _DIM_MULTIPLE) - self.k

  @property
  def v_pad(self) -> int:
    return round_up(self.v, _DIM_MULTIPLE) - self.v

  @property
  def k_boundary(self) -> int:
    """K width of the boundary kernel and of the saved-state layout it writes."""
    return round_up(self.k + self.k_pad, self.k_part_boundary)

  @property
  def k_bwd(self) -> int:
    """K width of the backward walk."""
    return round_up(self.k + self.k_pad, self.k_part_bwd * self.k_split_bwd)


def _block_v(v_padded: int, k_padded: int, elements: int, minimum: int = 1) -> int:
  """V-tile: the largest power of two dividing v_padded with <= `elements` per tile."""
  bv = next_power_of_two(v_padded)
  while bv > minimum and (v_padded % bv or bv * k_padded > elements):
    bv //= 2
  return bv


def forward_block_v(v_padded: int, k_part: int, num_warps: int) -> int:
  """Forward-walk V-tile: about 256 state entries per K-part and warp."""
  return min(largest_power_of_two_dividing(v_padded), 256 * num_warps // k_part)


def _compute_capability() -> tuple[int, int]:
  """(major, minor) of the default device; (0, 0) where it is not a CUDA GPU."""
  version = getattr(jax.devices()[0], "compute_capability", "0.0")
  major, minor = str(version).split(".")[:2]
  return int(major), int(minor)


def deterministic_ops_requested() -> bool:
  """Whether XLA_FLAGS asks XLA for run-to-run deterministic GPU ops
  (--xla_gpu_deterministic_ops or =true); the kernel then avoids reduce-add."""
  flags = os.environ.get("XLA_FLAGS", "")
  return re.search(r"--xla_gpu_deterministic_ops(=(true|1))?(\s|$)", flags) is not None


def backward_walk_kernel(row_dtypes, chunk: int, sub: int, interpret: bool) -> str:
  """"mosaic" where walk_mosaic runs: compiled on Hopper or newer with rows that fit its
  shared memory, or interpreted on a single device; else "triton".

  Mosaic GPU's interpret mode keeps one shared-memory state per process and checks at
  the end of each kernel that no barrier is left in it, so kernels interpreted by
  several devices at once (a CPU mesh under kernel_sharding) fail that check.
  row_dtypes: of the backward walk's rows q, k, v, beta, dO (and dvar).
  """
  if not walk_mosaic.supported(chunk, sub, row_dtypes, interpret=interpret):
    return "triton"
  if interpret:
    return "mosaic" if jax.local_device_count() == 1 else "triton"
  return "mosaic" if _compute_capability() >= (9, 0) else "triton"


def make_config(q, v, log_alpha, prior_precision, *, return_variance, chunk_size,
                interpret, k_dtype=None, beta_dtype=None) -> Config:
  """Checks what the kernel supports and picks tiles (k_dtype, beta_dtype: taken as
  q's and v's when not given)."""
  b, t, h, k = q.shape
  vdim = v.shape[-1]
  if k > _MAX_DIM or vdim > _MAX_DIM:
    raise NotImplementedError(
        f"palimpsa_gpu supports K, V <= {_MAX_DIM}; got K={k}, V={vdim}")
  kp = round_up(k, _DIM_MULTIPLE)
  chunk = next_power_of_two(max(16, min(chunk_size, t)))
  chunk = min(chunk, 128)
  vp = round_up(vdim, _DIM_MULTIPLE)
  # Tiles from the H200 sweeps (docs/archive/RESULTS.md, runs 2-4, 11, 14). Forward walk:
  # K-parts of 8-32 columns, about 256 state entries per part and warp. Boundary
  # kernel (run 14): one program per K-part of 16 or 32 columns (no padding) and V-tile
  # of up to 2048 entries, a warp per 512 entries. Backward walk (run 16): single-warp
  # programs over one [16, 16] state tile each (K cut into 16-column slices, no
  # padding), sub-chunks of 4 steps, the next sub-chunk's rows loaded a body ahead; at
  # K=16, 8-column parts over ~512 entries.
  largest = largest_power_of_two_dividing(kp)
  k_part = 8 if kp == 16 else min(largest, 32)
  # Two warps for 32-column parts, or where V lets the tile double (M170: 1.016x, run 14).
  num_warps = 2 if (k_part == 32 or forward_block_v(vp, k_part, 2)
                    > forward_block_v(vp, k_part, 1)) else 1
  k_part_boundary = min(largest, 32)
  block_v_boundary = _block_v(vp, k_part_boundary, 2048, minimum=16)
  if kp == 16:
    k_part_bwd, k_split_bwd, block_v_bwd, groups_bwd = 8, 1, _block_v(vp, kp, 512), 1
  else:
    k_part_bwd, k_split_bwd, block_v_bwd, groups_bwd = 16, kp // 16, 16, vp // 16
  row_dtypes = [q.dtype, k_dtype or q.dtype, v.dtype, beta_dtype or v.dtype,
                v.dtype]  # dO has the output's dtype.
  if return_variance:
    row_dtypes.append(jnp.float32)
  sub = 4
  return Config(b=b, t=t, h=h, k=k, v=vdim, chunk=chunk,
                block_v=forward_block_v(vp, k_part, num_warps),
                block_v_bwd=block_v_bwd,
                block_v_boundary=block_v_boundary,
                k_part=k_part, k_part_boundary=k_part_boundary, k_part_bwd=k_part_bwd,
                k_split_bwd=k_split_bwd, prefetch_bwd=kp > 16, unroll=2, sub=sub,
                groups_bwd=groups_bwd,
                num_warps=num_warps, num_warps_bwd=1,
                num_warps_boundary=max(1, block_v_boundary * k_part_boundary // 512),
                return_variance=return_variance,
                log_alpha_dtype=jnp.dtype(log_alpha.dtype).name,
                prior_dtype=jnp.dtype(prior_precision.dtype).name,
                interpret=interpret,
                walk_bwd=backward_walk_kernel(row_dtypes, chunk, sub, interpret),
                accumulate_bwd=not interpret and not deterministic_ops_requested())


def _prepare(cfg: Config, q, k, v, beta, log_alpha, prior_precision, segment_ids):
  """Head-major copies of q, k, v, beta for the backward walk (q, k at its width)."""
  tp, vp = cfg.t_pad, cfg.v_pad
  qh = layout.to_head_major(q, tp, cfg.k_bwd - cfg.k)
  kh = layout.to_head_major(k, tp, cfg.k_bwd - cfg.k)
  vh = layout.to_head_major(v, tp, vp)
  betah = layout.to_head_major(beta, tp, vp)
  gates = layout.make_gates(log_alpha, segment_ids, cfg.h, tp, cfg.chunk)
  ip = jnp.tile(prior_precision.astype(jnp.float32), cfg.b)  # [BH]
  return qh, kh, vh, betah, gates, ip


def _ip_row(ip: jax.Array, width: int) -> jax.Array:
  """[BH] -> [BH, width]: the prior precision of every column, padded ones included."""
  return jnp.broadcast_to(ip[:, None], (ip.shape[0], width))


def _pad_k(x: jax.Array, width: int) -> jax.Array:
  """Zero-pads the last axis to `width`."""
  pad = ((0, 0),) * (x.ndim - 1) + ((0, width - x.shape[-1]),)
  return jnp.pad(x, pad)


def _pad_state(cfg: Config, x: jax.Array, k_width: int) -> jax.Array:
  """[..., V, K] -> [..., Vp, k_width] with zeros in the padding."""
  pad = ((0, 0),) * (x.ndim - 2) + ((0, cfg.v_pad), (0, k_width - cfg.k))
  return jnp.pad(x, pad)


def _initial_linear_state(cfg: Config, initial_mu, initial_precision, ip, k_width):
  """(M0, Ibar0) [BH, Vp, k_width]; padded entries sit at the prior (M=0, Ibar=0)."""
  shape = (cfg.b * cfg.h, cfg.v, cfg.k)
  i0 = initial_precision.astype(jnp.float32).reshape(shape)
  m0 = initial_mu.astype(jnp.float32).reshape(shape) * i0
  return _pad_state(cfg, m0, k_width), _pad_state(cfg, i0 - ip[:, None, None], k_width)


def backward_starts(cfg: Config, saved: jax.Array) -> jax.Array:
  """Saved boundary states [BH, NC, V, K] -> the backward walk's [BH, NC, Vp, Ks].

  A walk in one K-part reads the columns past Ks = K + k_pad (a multiple of 16: usually
  no copy) up to its own width as zeros; K-parts or K-slices need Ks = k_bwd.
  """
  one_part = cfg.k_part_bwd == cfg.k_bwd
  return _pad_state(cfg, saved, cfg.k + cfg.k_pad if one_part else cfg.k_bwd)


def forward_rows(cfg: Config, caller, head_major):
  """The rows the forward kernels read: (q, k, v, beta, k padded to k_boundary).

  caller: (q, k, v, beta) as [B, T, H, D]; head_major: their `_prepare` copies.
  With cfg.caller_rows the caller's layout padded, else the head-major copies the
  backward reads (q and k cut to the forward's width); cfg.row_heads tells the kernels
  which.
  """
  if not cfg.caller_rows:
    qh, kh, vh, betah = head_major
    qh, kh = qh[..., :cfg.k + cfg.k_pad], kh[..., :cfg.k + cfg.k_pad]
    return qh, kh, vh, betah, _pad_k(kh, cfg.k_boundary)
  q, k, v, beta = caller
  q_rows, k_rows = (layout.pad_rows(x, cfg.t_pad, cfg.k_pad) for x in (q, k))
  v_rows, beta_rows = (layout.pad_rows(x, cfg.t_pad, cfg.v_pad) for x in (v, beta))
  return (q_rows, k_rows, v_rows, beta_rows,
          layout.pad_rows(k, cfg.t_pad, cfg.k_boundary - cfg.k))


def _forward(cfg: Config, q, k, v, beta, log_alpha, prior_precision, initial_mu,
             initial_precision, segment_ids):
  qh, kh, vh, betah, gates, ip = _prepare(
      cfg, q, k, v, beta, log_alpha, prior_precision, segment_ids)
  m0, b0 = _initial_linear_state(cfg, initial_mu, initial_precision, ip, cfg.k_boundary)
  q_rows, k_rows, v_rows, beta_rows, k_bound = forward_rows(
      cfg, (q, k, v, beta), (qh, kh, vh, betah))
  m_starts, b_starts, m_final, b_final = boundary.boundary_states(
      k_bound, v_rows, beta_rows, gates.to_end, gates.chunk, m0, b0, heads=cfg.row_heads,
      chunk=cfg.chunk, block_v=cfg.block_v_boundary, k_part=cfg.k_part_boundary,
      split=cfg.split_boundary, bf16_products=cfg.boundary_bf16,
      num_warps=cfg.num_warps_boundary, num_stages=cfg.num_stages_boundary,
      interpret=cfg.interpret)
  outs = walk.walk_forward(
      q_rows, k_rows, v_rows, beta_rows, gates.step, _ip_row(ip, cfg.k + cfg.k_pad), m_starts,
      b_starts, heads=cfg.h, caller_rows=cfg.caller_rows, chunk=cfg.chunk,
      block_v=cfg.block_v, unroll=cfg.unroll, prefetch=cfg.prefetch, k_part=cfg.k_part,
      with_var=cfg.return_variance, out_dtype=v.dtype, num_warps=cfg.num_warps,
      interpret=cfg.interpret)
  # The walk writes [B, Tp, H, Vp]: the caller's layout, padded.
  out = outs[0][:, :cfg.t, :, :cfg.v]
  var = outs[1][:, :cfg.t, :, :cfg.v] if cfg.return_variance else None
  i_final = b_final + ip[:, None, None]
  mu_final = layout.state_from_head_major(m_final / i_final, cfg.b, cfg.h, cfg.v,
                                          cfg.k)
  prec_final = layout.state_from_head_major(i_final, cfg.b, cfg.h, cfg.v, cfg.k)
  # The saved states drop the V/K padding (zero there: padded entries stay at the
  # prior), so the chunk-boundary ones take (T/chunk) * V * K * 2 floats per
  # batch-head; the backward pads them again.
  unpad = lambda x: x[..., :cfg.v, :cfg.k]
  residuals = (qh, kh, vh, betah, gates, ip, unpad(m_starts), unpad(b_starts),
               unpad(m_final), unpad(b_final), var, initial_mu, initial_precision)
  return (out, var, mu_final, prec_final), residuals


def _segmented_reverse_cumsum(x: jax.Array, reset: jax.Array) -> jax.Array:
  """y_t = sum of x_u over u >= t up to (excluding) the next restart after t.

  x, reset: [BH, Tp]; reset_u True starts a new segment at u.
  """
  # Reverse time; a restart at u ends the reversed segment after position u.
  xr = jnp.flip(x, -1)
  stop = jnp.flip(reset, -1)

  def combine(left, right):
    lv, ls = left
    rv, rs = right
    return jnp.where(rs, rv, lv + rv), ls | rs

  # Segmented inclusive scan where a flag on an element starts a new segment at it:
  # the reversed sequence starts a new segment right after each restart.
  starts = jnp.concatenate([jnp.zeros_like(stop[:, :1]), stop[:, :-1]], axis=-1)
  vals, _ = jax.lax.associative_scan(combine, (xr, starts), axis=-1)
  return jnp.flip(vals, -1)


def _backward(cfg: Config, residuals, cotangents):
  (qh, kh, vh, betah, gates, ip, m_starts, b_starts, m_final, b_final, var,
   initial_mu, initial_precision) = residuals
  d_out, d_var, d_mu_final, d_prec_final = cotangents
  # The backward works with K padded to k_bwd (zeros; padded entries stay at the prior):
  # q and k come at that width, the boundary states are read as zero past theirs.
  kw = cfg.k_bwd
  m_starts, b_starts = backward_starts(cfg, m_starts), backward_starts(cfg, b_starts)
  m_final, b_final = _pad_state(cfg, m_final, kw), _pad_state(cfg, b_final, kw)
  f32 = jnp.float32
  bh, tp, kp = qh.shape
  vp = vh.shape[-1]
  nc = tp // cfg.chunk
  doh = layout.to_head_major(d_out, cfg.t_pad, cfg.v_pad)
  dvarh = (layout.to_head_major(d_var, cfg.t_pad, cfg.v_pad, f32)
           if cfg.return_variance else None)
  walk_outs = []
  ip_row = _ip_row(ip, kw)
  size = bh // cfg.walk_pieces
  for first in range(0, bh, size):
    walk_args = (qh, kh, vh, betah, gates.step, ip_row, doh, dvarh, m_starts, b_starts)
    if cfg.walk_bwd == "mosaic":
      outs = walk_mosaic.walk_backward(*walk_args, chunk=cfg.chunk, sub=cfg.sub,
                                       interpret=cfg.interpret, bh_range=(first, size),
                                       accumulate=cfg.accumulate_bwd)
    else:
      outs = walk.walk_backward(
          *walk_args, chunk=cfg.chunk, block_v=cfg.block_v_bwd, sub=cfg.sub,
          groups=cfg.groups_bwd, k_part=cfg.k_part_bwd, k_split=cfg.k_split_bwd,
          num_warps=cfg.num_warps_bwd, interpret=cfg.interpret, prefetch=cfg.prefetch_bwd,
          bh_range=(first, size))
    dq, dk, dv, dbeta, s, adj_m, adj_b = outs
    walk_outs.append((jnp.sum(dq, axis=0), jnp.sum(dk, axis=0), jnp.sum(dv, axis=0),
                      jnp.sum(dbeta, axis=0), jnp.sum(s, axis=(0, 1)), adj_m, adj_b))
  dq, dk, dv, dbeta, s, adj_m, adj_b = (
      xs[0] if len(xs) == 1 else jnp.concatenate(xs) for xs in zip(*walk_outs))

  # Adjoint of the final linear state.
  ipb = ip[:, None, None]
  i_final = b_final + ipb
  r_final = 1.0 / i_final
  mu_final = m_final * r_final
  dmu_f = layout.state_to_head_major(d_mu_final.astype(f32), cfg.v_pad, kw - cfg.k)
  dprec_f = layout.state_to_head_major(d_prec_final.astype(f32), cfg.v_pad,
                                       kw - cfg.k)
  dm_end = dmu_f * r_final
  db_end = dprec_f - dmu_f * mu_final * r_final
  carry_m, carry_b, dm0, db0 = boundary.adjoint_carries(
      dm_end, db_end, gates.chunk, adj_m, adj_b, block_v=_block_v(vp, kw, 1024),
      interpret=cfg.interpret)

  # Carries are constant inside a chunk: their contributions are matmuls.
  c = cfg.chunk
  kf = kh.astype(f32).reshape(bh, nc, c, kp)
  vf = vh.astype(f32).reshape(bh, nc, c, vp)
  betaf = betah.astype(f32).reshape(bh, nc, c, vp)
  w = gates.to_end.reshape(bh, nc, c, 1)
  ein = functools.partial(jnp.einsum, precision=boundary.dot_precision(cfg.interpret))
  dv = dv + (w * ein("nctk,ncvk->nctv", kf, carry_m)).reshape(bh, tp, vp)
  dbeta = dbeta + (w * ein("nctk,ncvk->nctv", kf * kf, carry_b)).reshape(bh, tp, vp)
  dk_carry = ein("nctv,ncvk->nctk", vf, carry_m) + 2.0 * kf * ein(
      "nctv,ncvk->nctk", betaf, carry_b)
  dk = dk + (w * dk_carry).reshape(bh, tp, kp)

  # dlog_alpha via the scaling identity (segment-wise reverse sums).
  # s [BH, Tp]: sum_{v,k} dL/dI_t (local).
  m_term = -ip[:, None] * s - jnp.sum(vh.astype(f32) * dv, -1) - jnp.sum(
      betah.astype(f32) * dbeta, -1)
  if cfg.return_variance:
    var_term = jnp.sum(d_var.astype(f32) * var, -1)  # [B, T, H]
    var_term = jnp.transpose(var_term, (0, 2, 1)).reshape(bh, cfg.t)
    m_term = m_term - jnp.pad(var_term, ((0, 0), (0, cfg.t_pad)))
  final_term = jnp.sum(dm_end * m_final + db_end * b_final, axis=(1, 2))
  m_term = m_term.at[:, -1].add(final_term)
  dla = _segmented_reverse_cumsum(m_term, gates.reset)
  dla = jnp.where(gates.reset, 0.0, dla)

  # Prior precision: I_t = Ibar_t + Ip at every step, Ibar_0 = I_0 - Ip.
  d_ip = jnp.sum(s, -1) + jnp.sum(db_end, (1, 2)) - jnp.sum(db0, (1, 2))
  d_ip = d_ip.reshape(cfg.b, cfg.h).sum(0)

  # Initial state: M_0 = mu_0 * I_0, Ibar_0 = I_0 - Ip.
  b, h, v, k = cfg.b, cfg.h, cfg.v, cfg.k
  dm0 = layout.state_from_head_major(dm0, b, h, v, k)
  db0 = layout.state_from_head_major(db0, b, h, v, k)
  mu0 = initial_mu.astype(f32)
  i0 = initial_precision.astype(f32)
  d_mu0 = dm0 * i0
  d_i0 = dm0 * mu0 + db0

  def back(x, d, dtype):
    return layout.from_head_major(x, b, h, cfg.t, d).astype(dtype)

  dla = jnp.transpose(dla[:, :cfg.t].reshape(b, h, cfg.t), (0, 2, 1))
  return (back(dq, k, qh.dtype), back(dk, k, kh.dtype), back(dv, v, vh.dtype),
          back(dbeta, v, betah.dtype), dla.astype(cfg.log_alpha_dtype),
          d_ip.astype(cfg.prior_dtype), d_mu0.astype(initial_mu.dtype),
          d_i0.astype(initial_precision.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _palimpsa(cfg, q, k, v, beta, log_alpha, prior_precision, initial_mu,
              initial_precision, segment_ids):
  outputs, _ = _forward(cfg, q, k, v, beta, log_alpha, prior_precision,
                        initial_mu, initial_precision, segment_ids)
  return outputs


def _palimpsa_fwd(cfg, q, k, v, beta, log_alpha, prior_precision, initial_mu,
                  initial_precision, segment_ids):
  outputs, residuals = _forward(cfg, q, k, v, beta, log_alpha, prior_precision,
                                initial_mu, initial_precision, segment_ids)
  return outputs, residuals


def _palimpsa_bwd(cfg, residuals, cotangents):
  return _backward(cfg, residuals, cotangents) + (None,)


_palimpsa.defvjp(_palimpsa_fwd, _palimpsa_bwd)


def _check_nvidia_gpu() -> None:
  """The compiled kernels use Triton with inline PTX: NVIDIA GPUs only."""
  device = jax.devices()[0]
  if device.platform != "gpu" or "rocm" in device.client.platform_version.lower():
    raise NotImplementedError(
        "palimpsa_gpu needs an NVIDIA GPU as the default device (or interpret=True); "
        f"got {device.platform!r} ({device.client.platform_version})")


def palimpsa_gpu(q, k, v, beta, log_alpha, prior_precision, initial_mu,
                 initial_precision, segment_ids, *, return_variance: bool,
                 chunk_size: int, interpret: bool):
  """Exact Palimpsa (docs/math.md) with Pallas GPU kernels; differentiable.

  Args:
    q, k: [B, T, H, K]; v, beta: [B, T, H, V] (beta >= 0); log_alpha: [B, T, H]
      (<= 0); prior_precision: [H] (> 0); initial_mu, initial_precision:
      [B, H, V, K] float32; segment_ids: [B, T] int32 or None.
    return_variance: also return sum_k q^2 / I_t.
    chunk_size: chunk length of the two-level scheme: min(chunk_size, T) rounded up to a
      power of two, then clamped to [16, 128].
    interpret: run the Pallas kernels in interpret mode (CPU).

  Returns:
    (out [B, T, H, V] dtype of v, variance [B, T, H, V] f32 or None,
     mu_final [B, H, V, K] f32, precision_final [B, H, V, K] f32).

  Raises:
    NotImplementedError: K or V larger than 256, or a compiled call (interpret=False)
      without an NVIDIA GPU as the default backend.
  """
  if not interpret:
    _check_nvidia_gpu()
  cfg = make_config(q, v, log_alpha, prior_precision,
                    return_variance=return_variance, chunk_size=chunk_size,
                    interpret=interpret, k_dtype=k.dtype, beta_dtype=beta.dtype)
  return _palimpsa(cfg, q, k, v, beta, log_alpha, prior_precision, initial_mu,
                   initial_precision, segment_ids)

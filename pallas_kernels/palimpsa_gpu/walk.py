"""Pallas (Triton) kernels that walk the steps of one chunk.

Forward: grid (B*H, chunk, V-tile); each program starts from its chunk-boundary state
[BV, Kp] (float32, in registers) and steps through the chunk one token at a time.
Backward: grid (B*H, chunk, V-tile group); each program loops over its V-tiles,
recomputes the states of its chunk sub-chunk by sub-chunk (sub-chunk start states go
through a per-program scratch output; a sub-chunk's rows are loaded once for its
recompute and its reverse steps), and walks them in reverse, accumulating dq and dk
over its V-tiles.
Both hold the state as K-parts ([BV, k_part] tensors: Triton shapes are powers of two,
so K=48 is three parts of 16 rather than one padded to 64) and write the state and
adjoint updates as explicit FMAs.
"""

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.common import fast_reciprocal, fma, k_parts


def _params(num_warps: int, interpret: bool):
  if interpret:
    return None
  return plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=1)


def _barrier(interpret: bool):
  """Orders a program's global-memory writes before its later reads (GPU only)."""
  if not interpret:
    plgpu_triton.debug_barrier()


def _total(xs: list[jax.Array]) -> jax.Array:
  """Sum of a list of arrays (the K-parts' reductions)."""
  return functools.reduce(operator.add, xs)


def _forward_kernel(q_ref, k_ref, v_ref, beta_ref, a_ref, ip_ref, m0_ref, b0_ref,
                    *out_refs, chunk, unroll, prefetch, k_part, with_var, interpret):
  """Walks one chunk for one V-tile, writing readouts (and variances).

  The state [BV, Kp] is held as K-parts ([BV, k_part] each) in registers.
  """
  out_ref = out_refs[0]
  var_ref = out_refs[1] if with_var else None
  parts = k_parts(k_ref.shape[-1], k_part)
  ips = [ip_ref[p].astype(jnp.float32)[None, :] for p in parts]

  def row(ref, t, p):
    return ref[t, p].astype(jnp.float32)[None, :]

  def load(t0):  # The rows of steps t0 .. t0 + unroll - 1.
    return [([row(k_ref, t0 + s, p) for p in parts],
             [row(q_ref, t0 + s, p) for p in parts],
             v_ref[t0 + s, :].astype(jnp.float32)[:, None],
             beta_ref[t0 + s, :].astype(jnp.float32)[:, None],
             a_ref[t0 + s]) for s in range(unroll)]

  def steps(i, carry):
    ms, bs, queue = carry
    t0 = i * unroll
    # Rows are loaded `prefetch` bodies ahead, so their latency overlaps the arithmetic
    # (the last bodies reload the chunk's last rows, unused).
    rows, queue = queue[0], queue[1:] + [
        load(jnp.minimum(t0 + prefetch * unroll, chunk - unroll))]
    for s, (ks, qs, v, beta, a) in enumerate(rows):
      ms = [fma(a, m, v * k, interpret=interpret) for m, k in zip(ms, ks)]
      bs = [fma(a, b, beta * (k * k), interpret=interpret) for b, k in zip(bs, ks)]
      rs = [fast_reciprocal(b + ip, interpret=interpret) for b, ip in zip(bs, ips)]
      out = _total([jnp.sum(m * r * q, axis=1) for m, r, q in zip(ms, rs, qs)])
      out_ref[t0 + s, :] = out.astype(out_ref.dtype)
      if with_var:
        var_ref[t0 + s, :] = _total([jnp.sum(r * (q * q), axis=1) for r, q in zip(rs, qs)])
    return ms, bs, queue

  initial = ([m0_ref[:, p] for p in parts], [b0_ref[:, p] for p in parts],
             [load(j * unroll) for j in range(prefetch)])
  jax.lax.fori_loop(0, chunk // unroll, steps, initial)


def walk_forward(q, k, v, beta, a, ip_row, m_starts, b_starts, *, chunk: int,
                 block_v: int, unroll: int, prefetch: int, k_part: int, with_var: bool,
                 out_dtype, num_warps: int, interpret: bool):
  """Readouts of every step.

  Args:
    q, k: [BH, Tp, Kp]; v, beta: [BH, Tp, Vp]; a: [BH, Tp] step gates;
    ip_row: [BH, Kp] prior precision; m_starts, b_starts: [BH, NC, Vp, Ks] with
    Ks >= Kp (columns past Kp are padding and not read).
    k_part: width of the K-parts (a power of two dividing Kp).
    unroll: steps per loop body; prefetch: bodies ahead that rows are loaded.

  Returns:
    [out [BH, Tp, Vp] out_dtype] + ([var [BH, Tp, Vp] f32] if with_var).
  """
  bh, tp, kp = q.shape
  vp, k_state = v.shape[-1], m_starts.shape[-1]
  nc, nv = tp // chunk, vp // block_v
  row_k = pl.BlockSpec((None, chunk, kp), lambda n, c, j: (n, c, 0))
  row_v = pl.BlockSpec((None, chunk, block_v), lambda n, c, j: (n, c, j))
  state = pl.BlockSpec((None, None, block_v, k_state), lambda n, c, j: (n, c, j, 0))
  out_shape = [jax.ShapeDtypeStruct((bh, tp, vp), out_dtype)]
  if with_var:
    out_shape.append(jax.ShapeDtypeStruct((bh, tp, vp), jnp.float32))
  if prefetch < 1 or chunk < prefetch * unroll:
    raise ValueError(f"prefetch={prefetch} must be >= 1 with prefetch * unroll <= chunk "
                     f"(unroll={unroll}, chunk={chunk})")
  kernel = functools.partial(_forward_kernel, chunk=chunk, unroll=unroll,
                             prefetch=prefetch, k_part=k_part, with_var=with_var,
                             interpret=interpret)
  return pl.pallas_call(
      kernel, grid=(bh, nc, nv),
      in_specs=[row_k, row_k, row_v, row_v,
                pl.BlockSpec((None, chunk), lambda n, c, j: (n, c)),
                pl.BlockSpec((None, kp), lambda n, c, j: (n, 0)), state, state],
      out_specs=[row_v] * len(out_shape), out_shape=out_shape,
      compiler_params=_params(num_warps, interpret), interpret=interpret,
      name="palimpsa_walk_forward",
  )(q, k, v, beta, a, ip_row, m_starts, b_starts)


def _backward_kernel(q_ref, k_ref, v_ref, beta_ref, a_ref, ip_ref, do_ref, dvar_ref,
                     m0_ref, b0_ref, dq_ref, dk_ref, dv_ref, dbeta_ref, s_ref,
                     am_ref, ab_ref, sm_ref, sb_ref, *, chunk, sub, block_v, v_part, k_part,
                     num_tiles, with_var, interpret):
  """Reverse walk of one chunk (one group of V-tiles), zero adjoint from later chunks.

  States and adjoints [BV, Kp] are held as a grid of [v_part, k_part] tiles (one entry
  per lane when v_part * k_part = 32): every reduction is an FMA chain across tiles
  followed by one cross-lane sum of a single tile.
  """
  f32 = jnp.float32
  kcols = k_parts(k_ref.shape[-1], k_part)
  n_rows = block_v // v_part
  ips = [ip_ref[c].astype(f32)[None, :] for c in kcols]
  n_sub = chunk // sub
  for c in kcols:
    dq_ref[:, c] = jnp.zeros((chunk, k_part), f32)
    dk_ref[:, c] = jnp.zeros((chunk, k_part), f32)
  s_ref[...] = jnp.zeros((chunk,), f32)

  first_tile = pl.program_id(2) * num_tiles

  def fma_(x, y, z):
    return x * y if z is None else fma(x, y, z, interpret=interpret)

  def tile(i, _):
    v0 = pl.multiple_of((first_tile + i) * block_v, block_v)
    vrows = [pl.ds(v0 + r * v_part, v_part) for r in range(n_rows)]
    lrows = [pl.ds(r * v_part, v_part) for r in range(n_rows)]  # Rows of the scratch.

    def column(ref, t):  # [BV] at step t -> one [v_part, 1] column per row tile.
      return [ref[t, rows].astype(f32)[:, None] for rows in vrows]

    def load_rows(t):
      k_rows = [k_ref[t, c].astype(f32) for c in kcols]
      ks = [k[None, :] for k in k_rows]
      return (k_rows, ks, [k * k for k in ks], column(v_ref, t), column(beta_ref, t),
              a_ref[t])

    def advance(ms, bs, row):
      _, ks, kks, vs, betas, a = row
      return ([[fma(a, m, v * k, interpret=interpret) for m, k in zip(mr, ks)]
               for mr, v in zip(ms, vs)],
              [[fma(a, b, beta * kk, interpret=interpret) for b, kk in zip(br, kks)]
               for br, beta in zip(bs, betas)])

    def load_state(ref, *index):
      return [[ref[(*index, rows, c)] for c in kcols] for rows in lrows]

    def store_state(ref, index, xs, scale=None):
      for rows, xr in zip(index, xs):
        for c, x in zip(kcols, xr):
          ref[(*rows, c)] = x if scale is None else scale * x

    def forward(j, carry):  # States before every sub-chunk, into the scratch.
      ms, bs = carry
      store_state(sm_ref, [(j, rows) for rows in lrows], ms)
      store_state(sb_ref, [(j, rows) for rows in lrows], bs)
      for s in range(sub):
        ms, bs = advance(ms, bs, load_rows(j * sub + s))
      return ms, bs

    jax.lax.fori_loop(0, n_sub, forward, (
        [[m0_ref[rows, c] for c in kcols] for rows in vrows],
        [[b0_ref[rows, c] for c in kcols] for rows in vrows]))
    _barrier(interpret)

    def backward(i, carry):
      # gms: adjoints of M at step t0 + sub; hbs: minus those of Ibar (not yet decayed
      # by that step's gate a_next).
      gms, hbs, a_next = carry
      j = n_sub - 1 - i
      t0 = j * sub
      ms, bs = load_state(sm_ref, j), load_state(sb_ref, j)
      # The sub-chunk's rows, loaded once for the recompute and the reverse steps.
      rows = [load_rows(t0 + s) for s in range(sub)]
      qs = [[q_ref[t0 + s, c].astype(f32)[None, :] for c in kcols] for s in range(sub)]
      dos = [column(do_ref, t0 + s) for s in range(sub)]
      states = []
      for s in range(sub):  # Recompute the sub-chunk's states, kept in registers.
        ms, bs = advance(ms, bs, rows[s])
        states.append((ms, bs))
      # Earlier V-tiles' sums, loaded up front so their latency is paid once.
      acc = [([dq_ref[t0 + s, c] for c in kcols], [dk_ref[t0 + s, c] for c in kcols],
              s_ref[t0 + s]) for s in range(sub)]
      for s in reversed(range(sub)):
        t = t0 + s
        k_rows, ks, kks, vs, betas, a = rows[s]
        ms, bs = states[s]
        dvars = column(dvar_ref, t) if with_var else [None] * n_rows
        # Per K-part: sum_v do mu (dq), sum_v gm v and sum_v hb beta (dk).
        dq_acc, dkv_acc, dkb_acc = [None] * len(kcols), [None] * len(kcols), [None] * len(kcols)
        ds_acc = None
        for r in range(n_rows):
          do, v, beta, dvar = dos[s][r], vs[r], betas[r], dvars[r]
          dv_acc = dbeta_acc = None
          for c in range(len(kcols)):
            q, k, m, b = qs[s][c], ks[c], ms[r][c], bs[r][c]
            # out = sum_k mu q with mu = m r, r = 1 / (b + Ip): dL/dm = do q r and
            # dL/db = -(do q r) mu (+ the variance's -dvar (q r)^2) = -p.
            rcp = fast_reciprocal(b + ips[c], interpret=interpret)
            mu = m * rcp
            dm = (do * q) * rcp
            p = dm * mu
            dq_acc[c] = fma_(do, mu, dq_acc[c])
            if with_var:
              qr = q * rcp
              p = fma(dvar, qr * qr, p, interpret=interpret)
              dq_acc[c] = fma(2.0 * dvar, qr, dq_acc[c], interpret=interpret)
            gm = fma(a_next, gms[r][c], dm, interpret=interpret)
            hb = fma(a_next, hbs[r][c], p, interpret=interpret)
            gms[r][c], hbs[r][c] = gm, hb
            dkv_acc[c] = fma_(gm, v, dkv_acc[c])
            dkb_acc[c] = fma_(hb, beta, dkb_acc[c])
            dv_acc = fma_(gm, k, dv_acc)
            dbeta_acc = fma_(hb, kks[c], dbeta_acc)
            ds_acc = p if ds_acc is None else ds_acc + p
          dv_ref[t, vrows[r]] = jnp.sum(dv_acc, axis=1)
          dbeta_ref[t, vrows[r]] = -jnp.sum(dbeta_acc, axis=1)
        a_next = a
        for c, col in enumerate(kcols):
          dq_ref[t, col] = acc[s][0][c] + jnp.sum(dq_acc[c], axis=0)
          dk_ref[t, col] = acc[s][1][c] + (jnp.sum(dkv_acc[c], axis=0) - 2.0 * k_rows[c]
                                           * jnp.sum(dkb_acc[c], axis=0))
        s_ref[t] = acc[s][2] - jnp.sum(jnp.sum(ds_acc, axis=0))
      return gms, hbs, a_next

    zeros = [[jnp.zeros((v_part, k_part), f32) for _ in kcols] for _ in vrows]
    gms, hbs, a_first = jax.lax.fori_loop(
        0, n_sub, backward, (zeros, [list(z) for z in zeros], jnp.float32(0.0)))
    store_state(am_ref, [(rows,) for rows in vrows], gms, a_first)
    store_state(ab_ref, [(rows,) for rows in vrows], hbs, -a_first)
    _barrier(interpret)
    return 0

  _barrier(interpret)
  jax.lax.fori_loop(0, num_tiles, tile, 0)


def walk_backward(q, k, v, beta, a, ip_row, do, dvar, m_starts, b_starts, *,
                  chunk: int, block_v: int, sub: int, groups: int, v_part: int,
                  k_part: int, num_warps: int, interpret: bool):
  """Reverse walk over all chunks, each with zero adjoint from later chunks.

  Grid (B*H, chunk, group): each program walks `Vp / block_v / groups` V-tiles in turn.

  Args:
    q, k: [BH, Tp, Kp]; v, beta, do: [BH, Tp, Vp]; dvar: [BH, Tp, Vp] or None;
    a: [BH, Tp]; ip_row: [BH, Kp]; m_starts, b_starts: [BH, NC, Vp, Kp].
    v_part, k_part: the state's register tiles [v_part, k_part] (powers of two
      dividing block_v and Kp; one entry per lane when their product is 32).

  Returns:
    dq, dk [groups, BH, Tp, Kp] (to be summed over groups; dk without the later
    chunks' part); dv, dbeta [BH, Tp, Vp] (chunk-local parts); s [groups, BH, Tp]
    (sum_{v,k} dL/dI_t, chunk-local, to be summed over groups); adj_m, adj_b
    [BH, NC, Vp, Kp]: each chunk's adjoint of the state before its first step.
  """
  bh, tp, kp = q.shape
  vp = v.shape[-1]
  nc = tp // chunk
  num_tiles = vp // block_v
  if num_tiles % groups:
    raise ValueError(f"groups={groups} must divide the {num_tiles} V-tiles")
  if block_v % v_part or kp % k_part:
    raise ValueError(f"v_part={v_part} and k_part={k_part} must divide block_v={block_v} "
                     f"and Kp={kp}")
  with_var = dvar is not None
  row_k = pl.BlockSpec((None, chunk, kp), lambda n, c, g: (n, c, 0))
  row_v = pl.BlockSpec((None, chunk, vp), lambda n, c, g: (n, c, 0))
  part_k = pl.BlockSpec((None, None, chunk, kp), lambda n, c, g: (g, n, c, 0))
  state = pl.BlockSpec((None, None, vp, kp), lambda n, c, g: (n, c, 0, 0))
  scratch = pl.BlockSpec((None, None, None, chunk // sub, block_v, kp),
                         lambda n, c, g: (n, c, g, 0, 0, 0))
  f32 = jnp.float32
  kernel = functools.partial(_backward_kernel, chunk=chunk, sub=sub, block_v=block_v,
                             v_part=v_part, k_part=k_part, num_tiles=num_tiles // groups,
                             with_var=with_var, interpret=interpret)
  if with_var:
    dvar_spec = row_v
  else:
    dvar = jnp.zeros((1, chunk, vp), f32)  # Never read.
    dvar_spec = pl.BlockSpec((None, chunk, vp), lambda n, c, g: (0, 0, 0))
  outs = pl.pallas_call(
      kernel, grid=(bh, nc, groups),
      in_specs=[row_k, row_k, row_v, row_v,
                pl.BlockSpec((None, chunk), lambda n, c, g: (n, c)),
                pl.BlockSpec((None, kp), lambda n, c, g: (n, 0)),
                row_v, dvar_spec, state, state],
      out_specs=[part_k, part_k, row_v, row_v,
                 pl.BlockSpec((None, None, chunk), lambda n, c, g: (g, n, c)),
                 state, state, scratch, scratch],
      out_shape=[jax.ShapeDtypeStruct((groups, bh, tp, kp), f32)] * 2
      + [jax.ShapeDtypeStruct((bh, tp, vp), f32)] * 2
      + [jax.ShapeDtypeStruct((groups, bh, tp), f32)]
      + [jax.ShapeDtypeStruct((bh, nc, vp, kp), f32)] * 2
      + [jax.ShapeDtypeStruct((bh, nc, groups, chunk // sub, block_v, kp), f32)] * 2,
      compiler_params=_params(num_warps, interpret), interpret=interpret,
      name="palimpsa_walk_backward",
  )(q, k, v, beta, a, ip_row, do, dvar, m_starts, b_starts)
  return outs[:7]

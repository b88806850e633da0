"""Fast Palimpsa's exact chunk-boundary states (M, Ibar) as Mosaic GPU kernels, with a
custom VJP.

The states are the exact op's linear form carried from chunk to chunk,
M_{c+1} = g_c M_c + sum_s w_s v_s k_s^T and Ibar_{c+1} = g_c Ibar_c + sum_s w_s beta_s (k_s^2)^T,
so the exact op's kernels compute them (pallas_kernels/palimpsa_gpu): the forward is its
boundary kernel (each chunk's write on tensor cores, the chunks walked in order), the backward
its adjoint-carries kernel (the chunks walked in reverse), and the carries' contributions to
the inputs are matmuls (a carry is constant inside a chunk).
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.palimpsa_gpu import boundary_mosaic, carries_mosaic

f32 = jnp.float32


def dot_precision(interpret: bool):
  """float32-accurate matmuls: three TF32 passes on tensor cores; plain float32 on CPU."""
  return jax.lax.Precision.HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def supported(chunk: int, kp: int, vp: int, k_dtype, x_dtype, *, interpret: bool) -> bool:
  """Whether the boundary kernel takes a chunk of `chunk` steps and [Vp, Kp] states."""
  return boundary_mosaic.supported(chunk, boundary_mosaic.default_k_part(kp), vp, k_dtype,
                                   x_dtype, interpret=interpret)


def _head_major_chunks(x, chunk):
  """[B, Tp, H, D] -> [B*H, NC, C, D] float32."""
  b, tp, h, d = x.shape
  return jnp.moveaxis(x.astype(f32), 2, 1).reshape(b * h, tp // chunk, chunk, d)


def _caller_rows(x, b, h, dtype):
  """[B*H, NC, C, D] -> [B, Tp, H, D] in dtype."""
  _, nc, c, d = x.shape
  return jnp.moveaxis(x.reshape(b, h, nc * c, d), 1, 2).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def chunk_states(k, v, beta, to_end, chunk_gate, m0, b0, heads, chunk, interpret):
  """States (M, Ibar) entering every chunk, and after the last.

  Args:
    k: [B, Tp, H, Kp]; v, beta: [B, Tp, H, Vp] (Kp, Vp multiples of 16, zero padding;
      Tp a multiple of chunk), float32 or bfloat16.
    to_end: [BH, Tp] decay from each step to its chunk's end (0 across a restart).
    chunk_gate: [BH, NC] decay across each chunk (0 if a segment restarts in it).
    m0, b0: [BH, Vp, Kp] float32, the state before step 0.
    heads: H; chunk: steps per chunk (16, 32, 64 or 128); interpret: run interpreted.

  Returns:
    m_starts, b_starts [BH, NC, Vp, Kp]; m_final, b_final [BH, Vp, Kp]; float32.
  """
  return _states_fwd(k, v, beta, to_end, chunk_gate, m0, b0, heads, chunk, interpret)[0]


def _states_fwd(k, v, beta, to_end, chunk_gate, m0, b0, heads, chunk, interpret):
  outs = boundary_mosaic.boundary_states(
      k, v, beta, to_end, chunk_gate, m0, b0, heads=heads, chunk=chunk,
      k_part=boundary_mosaic.default_k_part(k.shape[-1]), interpret=interpret)
  # The starts are kept only for this VJP: the op recomputes the whole forward in its
  # backward (jax.checkpoint), so they live from that recomputation to this backward.
  return outs, (k, v, beta, to_end, chunk_gate, outs[0], outs[1])


def _states_bwd(heads, chunk, interpret, residuals, cotangents):
  k, v, beta, to_end, chunk_gate, m_starts, b_starts = residuals
  dm_starts, db_starts, dm_final, db_final = cotangents
  carry_m, carry_b, dm0, db0 = carries_mosaic.adjoint_carries(
      dm_final, db_final, chunk_gate, dm_starts, db_starts, interpret=interpret)
  b = k.shape[0]
  kf, vf, betaf = (_head_major_chunks(x, chunk) for x in (k, v, beta))
  w = to_end.reshape(kf.shape[:3])[..., None]  # [BH, NC, C, 1]
  ein = functools.partial(jnp.einsum, precision=dot_precision(interpret))
  # carry k_s [V] and carry_b k_s^2 [V]: what each step's write meets at its chunk's end.
  reach_m = ein("nctk,ncvk->nctv", kf, carry_m)
  reach_b = ein("nctk,ncvk->nctv", kf * kf, carry_b)
  dv, dbeta = w * reach_m, w * reach_b
  dk = w * (ein("nctv,ncvk->nctk", vf, carry_m)
            + 2.0 * kf * ein("nctv,ncvk->nctk", betaf, carry_b))
  d_to_end = jnp.sum(vf * reach_m + betaf * reach_b, axis=-1).reshape(to_end.shape)
  d_chunk_gate = (jnp.sum(carry_m * m_starts, axis=(-2, -1))
                  + jnp.sum(carry_b * b_starts, axis=(-2, -1)))
  return (_caller_rows(dk, b, heads, k.dtype), _caller_rows(dv, b, heads, v.dtype),
          _caller_rows(dbeta, b, heads, beta.dtype), d_to_end, d_chunk_gate, dm0, db0)


chunk_states.defvjp(_states_fwd, _states_bwd)

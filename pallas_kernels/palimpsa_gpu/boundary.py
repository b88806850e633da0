"""Chunk-boundary states of the linear form (M = mu * I, Ibar = I - Ip) with matmuls."""

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def chunk_contributions(k: jax.Array, x: jax.Array, to_end: jax.Array,
                        chunk: int) -> jax.Array:
  """Each chunk's own decayed write, sum_t to_end_t x_t (x) k_t.

  Args:
    k: [BH, Tp, Kp] keys (or squared keys).
    x: [BH, Tp, Vp] values (or beta).
    to_end: [BH, Tp] decay from t to the chunk end.
    chunk: chunk length C.

  Returns:
    [BH, NC, Vp, Kp] float32.
  """
  bh, tp, kp = k.shape
  vp = x.shape[-1]
  nc = tp // chunk
  xw = (x.astype(jnp.float32) * to_end[..., None]).reshape(bh, nc, chunk, vp)
  kc = k.astype(jnp.float32).reshape(bh, nc, chunk, kp)
  return jnp.einsum("nctv,nctk->ncvk", xw, kc, precision=_HIGHEST)


def scan_chunks(start: jax.Array, chunk_gate: jax.Array,
                contrib: jax.Array) -> tuple[jax.Array, jax.Array]:
  """States at every chunk start and after the last chunk.

  Args:
    start: [BH, Vp, Kp] state before the first chunk.
    chunk_gate: [BH, NC] decay across each chunk.
    contrib: [BH, NC, Vp, Kp] each chunk's own write.

  Returns:
    ([BH, NC, Vp, Kp] states at chunk starts, [BH, Vp, Kp] final state).
  """

  def step(s, inputs):
    g, d = inputs
    return g[:, None, None] * s + d, s

  final, starts = jax.lax.scan(
      step, start, (jnp.moveaxis(chunk_gate, 1, 0), jnp.moveaxis(contrib, 1, 0)))
  return jnp.moveaxis(starts, 0, 1), final


def reverse_scan_chunks(end: jax.Array, chunk_gate: jax.Array,
                        local: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Adjoint carries: the adjoint entering each chunk's last step from later steps.

  carry_{NC-1} = end; carry_{c-1} = local_c + chunk_gate_c * carry_c.

  Args:
    end: [BH, Vp, Kp] adjoint of the final state.
    chunk_gate: [BH, NC].
    local: [BH, NC, Vp, Kp] each chunk's own adjoint of the state before it.

  Returns:
    ([BH, NC, Vp, Kp] carries at chunk ends, [BH, Vp, Kp] adjoint of the initial state).
  """

  def step(carry, inputs):
    g, a = inputs
    return a + g[:, None, None] * carry, carry

  initial, carries = jax.lax.scan(
      step, end, (jnp.moveaxis(chunk_gate, 1, 0), jnp.moveaxis(local, 1, 0)),
      reverse=True)
  return jnp.moveaxis(carries, 0, 1), initial

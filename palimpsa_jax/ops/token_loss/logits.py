"""The whole-logits form: the head's logits, then the loss of those logits."""

import functools

import jax
import jax.numpy as jnp


def accumulation(dtype) -> jnp.dtype:
  """float32, or float64 for float64 inputs (tests against float64 references)."""
  return jnp.promote_types(dtype, jnp.float32)


def head_logits(h: jax.Array, table: jax.Array) -> jax.Array:
  """Logits [B, T, vocab] float32 (float64 for float64 h) of h [B, T, d] against table [vocab, d].

  The products accumulate in float32. The backward rounds the logits' cotangent to h's dtype,
  so with bf16 compute both gradient matmuls run in bf16 (accumulated in float32); plain
  autodiff would promote them to float32 matmuls against the float32 cotangent, which on an
  H200 took 5 ms of a 174 ms Palimpsa-D 170M step. Both directions take the matmul precision in
  force at the call (jax.default_matmul_precision).
  """
  return _head_logits(h, table, jax.config.jax_default_matmul_precision)


def logits_product(h: jax.Array, table: jax.Array, precision) -> jax.Array:
  """h [B, T, d] @ table [vocab, d]^T, accumulated in float32 (float64 for float64 h)."""
  return jnp.einsum("btd,vd->btv", h, table, precision=precision,
                    preferred_element_type=accumulation(h.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _head_logits(h, table, precision):
  return logits_product(h, table, precision)


def _head_logits_fwd(h, table, precision):
  return _head_logits(h, table, precision), (h, table)


def _head_logits_bwd(precision, residuals, d_logits):
  h, table = residuals
  g = d_logits.astype(h.dtype)
  dh = jnp.einsum("btv,vd->btd", g, table, precision=precision,
                  preferred_element_type=accumulation(h.dtype))
  d_table = jnp.einsum("btv,btd->vd", g, h, precision=precision,
                       preferred_element_type=accumulation(h.dtype))
  return dh.astype(h.dtype), d_table.astype(table.dtype)


_head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def losses_of_logits(logits: jax.Array, targets: jax.Array, counted: jax.Array
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(nll, correct, logsumexp) [B, T] of logits [B, T, vocab] (float32 or wider), differentiable.

  targets [B, T] int must lie in [0, vocab) where counted [B, T] bool is True; elsewhere they
  are ignored, nll is 0 and correct False.
  """
  safe_targets = jnp.where(counted, targets, 0)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, safe_targets[..., None], axis=-1)[..., 0]
  nll = jnp.where(counted, lse - picked, 0.0)
  correct = counted & (jnp.argmax(logits, axis=-1) == safe_targets)
  return nll, correct, lse

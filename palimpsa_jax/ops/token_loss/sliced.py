"""The sliced form: the loss of h @ table^T without the [positions, vocab] logits in memory at once.

The logits are computed a slice of positions at a time, in the forward and again in the
backward (a custom VJP), so only one slice's float32 logits exist at any moment. The whole-logits
form writes all of them once and reads them back for the softmax, the loss and the backward;
MQAR's loss at 16,384 query positions and a vocabulary of 8,192 holds 512 MiB of them.

Slices are strided (slice j holds positions j, j + S, j + 2S, ... of every row, for S slices),
so a sequence axis split over devices stays split inside each slice and the batch axis is never
cut. As in the whole-logits form, the backward rounds the logits' cotangent to h's dtype before
its two matmuls.
"""

import functools

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.token_loss.logits import accumulation, logits_product, losses_of_logits

# Logit elements (float32) one slice may hold: 64 MiB, small next to the whole logits at the
# project's shapes yet large enough that each slice's matmuls keep the GPU busy (slices run one
# after another).
SLICE_LOGITS = 1 << 24


def num_slices(batch: int, length: int, vocab: int) -> int:
  """The fewest slices, dividing `length`, whose logits stay within SLICE_LOGITS."""
  for count in range(1, length + 1):
    if length % count == 0 and batch * (length // count) * vocab <= SLICE_LOGITS:
      return count
  return length


def sliced_losses(h, table, targets, counted, precision):
  """(nll, correct, lse) [B, T], one slice of positions at a time (the module docstring)."""
  return _sliced(h, table, targets, counted, precision)


def _to_slices(x: jax.Array, count: int) -> jax.Array:
  """[B, T, ...] -> [count, B, T // count, ...]; slice j holds positions j, j + count, ..."""
  b, t = x.shape[:2]
  x = x.reshape((b, t // count, count) + x.shape[2:])
  return jnp.moveaxis(x, 2, 0)


def _from_slices(x: jax.Array) -> jax.Array:
  """The inverse of _to_slices."""
  x = jnp.moveaxis(x, 0, 2)
  return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _map_slices(fn, count: int, *xs):
  """fn over the slices of xs ([B, T, ...] each), results back to [B, T, ...]."""
  if count == 1:
    return fn(*xs)
  out = jax.lax.map(lambda args: fn(*args), tuple(_to_slices(x, count) for x in xs))
  return jax.tree.map(_from_slices, out)


def _forward(h, table, targets, counted, precision):
  """(nll, correct, logsumexp) [B, T] each."""
  def one_slice(h, targets, counted):
    return losses_of_logits(logits_product(h, table, precision), targets, counted)

  count = num_slices(*h.shape[:2], table.shape[0])
  return _map_slices(one_slice, count, h, targets, counted)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sliced(h, table, targets, counted, precision):
  return _forward(h, table, targets, counted, precision)


def _sliced_fwd(h, table, targets, counted, precision):
  nll, correct, lse = _forward(h, table, targets, counted, precision)
  return (nll, correct, lse), (h, table, targets, counted, lse)


def _sliced_bwd(precision, residuals, cotangents):
  h, table, targets, counted, lse = residuals
  d_nll, _, d_lse = cotangents
  # nll is 0 wherever the target does not count, whatever h and table are. With
  # p = softmax(logits): d nll / d logits = p - onehot(target), d lse / d logits = p.
  d_nll = jnp.where(counted, d_nll, 0.0)
  vocab = jnp.arange(table.shape[0])

  def one_slice(d_table, slice_args):
    h, targets, lse, d_nll, d_lse = slice_args
    probs = jnp.exp(logits_product(h, table, precision) - lse[..., None])
    hit = vocab == targets[..., None]
    # (probs - hit) first: exact where probs is near 1, and the nll alone adds 0 from lse.
    d_logits = ((probs - hit) * d_nll[..., None]
                + probs * d_lse[..., None]).astype(h.dtype)
    dh = jnp.einsum("btv,vd->btd", d_logits, table, precision=precision,
                    preferred_element_type=d_table.dtype)
    d_table = d_table + jnp.einsum("btv,btd->vd", d_logits, h, precision=precision,
                                   preferred_element_type=d_table.dtype)
    return d_table, dh.astype(h.dtype)

  count = num_slices(*h.shape[:2], table.shape[0])
  zeros = jnp.zeros(table.shape, accumulation(h.dtype))
  if count == 1:
    d_table, dh = one_slice(zeros, (h, targets, lse, d_nll, d_lse))
  else:
    sliced = tuple(_to_slices(x, count) for x in (h, targets, lse, d_nll, d_lse))
    d_table, dh = jax.lax.scan(one_slice, zeros, sliced)
    dh = _from_slices(dh)
  return dh, d_table.astype(table.dtype), None, None


_sliced.defvjp(_sliced_fwd, _sliced_bwd)

"""Cross-entropy of the tied head without the [positions, vocab] logits in memory at once.

`head_cross_entropy(h, table, targets)` equals the cross-entropy of the logits
h @ table^T (products accumulated in float32) at every position, but computes
those logits a slice of positions at a time, in the forward and again in the
backward (a custom VJP), so only one slice's float32 logits exist at any moment.
The unfused form writes the whole float32 logits once and reads them back for
the softmax, the loss and the backward; MQAR's loss at 16,384 query positions
and a vocabulary of 8,192 holds 512 MiB of them.

Slices are strided (slice j holds positions j, j + S, j + 2S, ... of every
row, for S slices), so a sequence axis split over devices stays split inside
each slice and the batch axis is never cut.

implementation="pallas_gpu" computes the same with Pallas kernels that keep every
tile of logits on chip (pallas_kernels/head_loss_triton.py; one NVIDIA GPU, d up to
256); the models take it with config.head_loss.
"""

import functools

import jax
import jax.numpy as jnp

from palimpsa_jax.data.mqar import IGNORE_INDEX
from pallas_kernels import head_loss_triton
from pallas_kernels.common import next_power_of_two, round_up

# Logit elements (float32) one slice may hold: 64 MiB, small next to the whole
# logits at the project's shapes yet large enough that each slice's matmuls keep
# the GPU busy (slices run one after another).
SLICE_LOGITS = 1 << 24


def num_slices(batch: int, length: int, vocab: int) -> int:
  """The fewest slices, dividing `length`, whose logits stay within SLICE_LOGITS."""
  for count in range(1, length + 1):
    if length % count == 0 and batch * (length // count) * vocab <= SLICE_LOGITS:
      return count
  return length


IMPLEMENTATIONS = ("xla", "pallas_gpu")


def head_cross_entropy(h: jax.Array, table: jax.Array, targets: jax.Array, *,
                       implementation: str = "xla", interpret: bool = False
                       ) -> tuple[jax.Array, jax.Array]:
  """Per-position cross-entropy and argmax hit of the logits h @ table^T.

  Args:
    h: [B, T, d] final hidden states (float32 or bfloat16).
    table: [vocab, d] output embedding, in h's dtype.
    targets: [B, T] int; IGNORE_INDEX marks positions that do not count.

  Returns:
    (nll [B, T] float32 (float64 for float64 h), 0 where ignored;
    correct [B, T] bool, whether the first maximal logit is the target, False
    where ignored). Gradients flow to h and table through nll; as in the
    unfused head, the backward rounds the logits' cotangent to h's dtype before
    its two matmuls.

  implementation: "xla" (slices of positions, above) or "pallas_gpu" (Pallas
  Triton kernels that keep each tile of logits on chip, pallas_kernels/head_loss_triton.py;
  d up to MAX_WIDTH; interpret=True runs them on CPU).
  """
  if h.ndim != 3 or table.ndim != 2 or h.shape[-1] != table.shape[-1]:
    raise ValueError(
        f"h must be [B, T, d] and table [vocab, d], got {h.shape} and {table.shape}")
  if targets.shape != h.shape[:2]:
    raise ValueError(f"targets must be [B, T] = {h.shape[:2]}, got {targets.shape}")
  if table.dtype != h.dtype:
    raise ValueError(f"table must have h's dtype {h.dtype}, got {table.dtype}")
  # The backward is traced after the caller's forward; it takes the matmul precision
  # in force now (jax.default_matmul_precision), as autodiff's own matmuls would.
  precision = jax.config.jax_default_matmul_precision
  if implementation == "pallas_gpu":
    return _pallas_cross_entropy(h, table, targets, precision, interpret)
  if implementation != "xla":
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  return _head_cross_entropy(h, table, targets, precision)


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


def _accumulation(dtype) -> jnp.dtype:
  """float32, or float64 for float64 inputs (tests against float64 references)."""
  return jnp.promote_types(dtype, jnp.float32)


def _logits(h, table, precision):
  return jnp.einsum("btd,vd->btv", h, table, precision=precision,
                    preferred_element_type=_accumulation(h.dtype))


def _forward(h, table, targets, precision):
  """(nll, correct, logsumexp) [B, T] each."""
  valid = targets != IGNORE_INDEX
  safe_targets = jnp.where(valid, targets, 0)

  def one_slice(h, safe_targets, valid):
    logits = _logits(h, table, precision)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, safe_targets[..., None], axis=-1)[..., 0]
    nll = jnp.where(valid, lse - picked, 0.0)
    correct = valid & (jnp.argmax(logits, axis=-1) == safe_targets)
    return nll, correct, lse

  count = num_slices(*h.shape[:2], table.shape[0])
  return _map_slices(one_slice, count, h, safe_targets, valid)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _head_cross_entropy(h, table, targets, precision):
  nll, correct, _ = _forward(h, table, targets, precision)
  return nll, correct


def _head_cross_entropy_fwd(h, table, targets, precision):
  nll, correct, lse = _forward(h, table, targets, precision)
  return (nll, correct), (h, table, targets, lse)


def _head_cross_entropy_bwd(precision, residuals, cotangents):
  h, table, targets, lse = residuals
  d_nll = cotangents[0]
  # nll is 0 wherever the target is ignored, whatever h and table are.
  weight = jnp.where(targets != IGNORE_INDEX, d_nll, 0.0)
  vocab = jnp.arange(table.shape[0])

  def one_slice(d_table, slice_args):
    h, targets, lse, weight = slice_args
    probs = jnp.exp(_logits(h, table, precision) - lse[..., None])
    hit = vocab == targets[..., None]
    d_logits = ((probs - hit) * weight[..., None]).astype(h.dtype)
    dh = jnp.einsum("btv,vd->btd", d_logits, table, precision=precision,
                    preferred_element_type=d_table.dtype)
    d_table = d_table + jnp.einsum("btv,btd->vd", d_logits, h, precision=precision,
                                   preferred_element_type=d_table.dtype)
    return d_table, dh.astype(h.dtype)

  count = num_slices(*h.shape[:2], table.shape[0])
  zeros = jnp.zeros(table.shape, _accumulation(h.dtype))
  if count == 1:
    d_table, dh = one_slice(zeros, (h, targets, lse, weight))
  else:
    sliced = tuple(_to_slices(x, count) for x in (h, targets, lse, weight))
    d_table, dh = jax.lax.scan(one_slice, zeros, sliced)
    dh = _from_slices(dh)
  return dh, d_table.astype(table.dtype), None


_head_cross_entropy.defvjp(_head_cross_entropy_fwd, _head_cross_entropy_bwd)


def _kernel_precision(precision, dtype, interpret: bool):
  """The kernels' dot algorithm for jax.default_matmul_precision's value: what XLA would
  run (float32: TF32 products unless float32 or highest is asked for; bfloat16 as given);
  plain products in interpret mode, where the CPU runs them exactly."""
  if interpret or dtype != jnp.float32:
    return None
  if precision in ("float32", "highest", "F32_F32_F32", jax.lax.Precision.HIGHEST):
    return jax.lax.DotAlgorithmPreset.F32_F32_F32
  if precision in ("bfloat16", "BF16_BF16_F32"):
    return jax.lax.DotAlgorithmPreset.BF16_BF16_F32
  return jax.lax.DotAlgorithmPreset.TF32_TF32_F32


def _pallas_cross_entropy(h, table, targets, precision, interpret):
  """head_cross_entropy through pallas_kernels.head_loss_triton: pads, flattens, unpads."""
  batch, length, width = h.shape
  vocab = table.shape[0]
  padded_width = max(16, next_power_of_two(width))
  if padded_width > head_loss_triton.MAX_WIDTH:
    raise ValueError(f"implementation='pallas_gpu' takes d up to "
                     f"{head_loss_triton.MAX_WIDTH}, got {width}; use 'xla'")
  n = batch * length
  rows = round_up(n, head_loss_triton.BLOCK_N)
  h2 = jnp.pad(h.reshape(n, width), ((0, rows - n), (0, padded_width - width)))
  table2 = jnp.pad(table, ((0, round_up(vocab, head_loss_triton.BLOCK_V) - vocab),
                           (0, padded_width - width)))
  flat_targets = jnp.pad(targets.reshape(n), (0, rows - n), constant_values=IGNORE_INDEX)
  nll, correct = _pallas_loss(h2, table2, flat_targets, vocab,
                              _kernel_precision(precision, h.dtype, interpret), interpret)
  return nll[:n].reshape(batch, length), correct[:n].reshape(batch, length)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _pallas_loss(h, table, targets, vocab, precision, interpret):
  return _pallas_loss_fwd(h, table, targets, vocab, precision, interpret)[0]


def _pallas_loss_fwd(h, table, targets, vocab, precision, interpret):
  valid = targets != IGNORE_INDEX
  safe_targets = jnp.where(valid, targets, 0).astype(jnp.int32)
  lse, picked, argmax = head_loss_triton.forward(h, table, safe_targets, vocab=vocab,
                                                 precision=precision, interpret=interpret)
  nll = jnp.where(valid, lse - picked, 0.0)
  correct = valid & (argmax == safe_targets)
  return (nll, correct), (h, table, safe_targets, valid, lse)


def _pallas_loss_bwd(vocab, precision, interpret, residuals, cotangents):
  h, table, safe_targets, valid, lse = residuals
  weight = jnp.where(valid, cotangents[0], 0.0).astype(jnp.float32)
  dh, d_table = head_loss_triton.backward(h, table, safe_targets, lse, weight, vocab=vocab,
                                          precision=precision, interpret=interpret)
  return dh, d_table.astype(table.dtype), None


_pallas_loss.defvjp(_pallas_loss_fwd, _pallas_loss_bwd)

"""Cross-entropy of a tied output head with no logits in memory: Pallas (Triton) kernels.

For hidden states h [N, D] and a table [V, D] the logits h @ table^T are made one
[block_n, block_v] tile at a time and never leave the chip. The forward keeps, per row,
the running maximum and sum of exponentials (the log-sum-exp), the target's logit and the
first maximal column. The backward makes the tiles again, turns each into
(softmax - onehot(target)) * weight, rounded to h's dtype, and multiplies it by the table
(dh: one program per block of rows, walking the vocabulary) or by h (dtable: one program
per block of the vocabulary, walking the rows).

The caller pads: N to a multiple of block_n, V to a multiple of block_v (columns past
`vocab` are masked), D to a power of two of at least 16 (zeros). models/head_loss.py
holds the contract and the XLA form these kernels are tested against.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

BLOCK_N = 64
BLOCK_V = 128
# Widest padded D the kernels keep in registers (a [block_n, D] float32 accumulator).
MAX_WIDTH = 256
_NUM_WARPS = 4
_NUM_STAGES = 2


def _tile(h, table, precision):
  """h [BN, D] @ table [BV, D]^T -> [BN, BV] float32."""
  return jax.lax.dot_general(h, table, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _columns(start, shape):
  return start + jax.lax.broadcasted_iota(jnp.int32, shape, 1)


def _forward_kernel(h_ref, table_ref, targets_ref, lse_ref, picked_ref, argmax_ref, *,
                    vocab, precision):
  h = h_ref[...]
  targets = targets_ref[...]
  block_n = h.shape[0]
  block_v = BLOCK_V

  def body(j, carry):
    running_max, total, picked, best, best_col = carry
    start = pl.multiple_of(j * block_v, block_v)
    logits = _tile(h, table_ref[pl.ds(start, block_v), :], precision)
    cols = _columns(start, logits.shape)
    logits = jnp.where(cols < vocab, logits, -jnp.inf)
    tile_max = jnp.max(logits, axis=1)
    new_max = jnp.maximum(running_max, tile_max)
    total = (total * jnp.exp(running_max - new_max)
             + jnp.sum(jnp.exp(logits - new_max[:, None]), axis=1))
    picked = picked + jnp.sum(jnp.where(cols == targets[:, None], logits, 0.0), axis=1)
    first = jnp.min(jnp.where(logits == tile_max[:, None], cols, vocab), axis=1)
    better = tile_max > best  # Strictly: an earlier tile keeps a tie.
    return (new_max, total, picked, jnp.where(better, tile_max, best),
            jnp.where(better, first, best_col))

  f32 = jnp.float32
  lowest = jnp.full((block_n,), -jnp.inf, f32)
  init = (lowest, jnp.zeros((block_n,), f32), jnp.zeros((block_n,), f32), lowest,
          jnp.zeros((block_n,), jnp.int32))
  running_max, total, picked, _, best_col = jax.lax.fori_loop(
      0, pl.cdiv(vocab, block_v), body, init)
  lse_ref[...] = running_max + jnp.log(total)
  picked_ref[...] = picked
  argmax_ref[...] = best_col


def _logit_grad(logits, cols, targets, lse, weight, vocab, dtype):
  """(softmax - onehot) * weight of one tile, 0 past `vocab`, in `dtype`."""
  probs = jnp.where(cols < vocab, jnp.exp(logits - lse[:, None]), 0.0)
  hit = (cols == targets[:, None]).astype(jnp.float32)
  return ((probs - hit) * weight[:, None]).astype(dtype)


def _dh_kernel(h_ref, table_ref, targets_ref, lse_ref, weight_ref, dh_ref, *, vocab,
               precision):
  h = h_ref[...]
  targets, lse, weight = targets_ref[...], lse_ref[...], weight_ref[...]
  block_v = BLOCK_V

  def body(j, acc):
    start = pl.multiple_of(j * block_v, block_v)
    table = table_ref[pl.ds(start, block_v), :]
    logits = _tile(h, table, precision)
    d_logits = _logit_grad(logits, _columns(start, logits.shape), targets, lse, weight,
                           vocab, h.dtype)
    return acc + jax.lax.dot_general(d_logits, table, (((1,), (0,)), ((), ())),
                                     precision=precision, preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, pl.cdiv(vocab, block_v), body,
                          jnp.zeros(h.shape, jnp.float32))
  dh_ref[...] = acc.astype(dh_ref.dtype)


def _dtable_kernel(h_ref, table_ref, targets_ref, lse_ref, weight_ref, dtable_ref, *,
                   vocab, num_rows, precision):
  table = table_ref[...]
  block_n = BLOCK_N
  start_col = pl.program_id(0) * table.shape[0]

  def body(i, acc):
    rows = pl.ds(pl.multiple_of(i * block_n, block_n), block_n)
    h = h_ref[rows, :]
    logits = _tile(h, table, precision)
    d_logits = _logit_grad(logits, _columns(start_col, logits.shape), targets_ref[rows],
                           lse_ref[rows], weight_ref[rows], vocab, h.dtype)
    return acc + jax.lax.dot_general(d_logits, h, (((0,), (0,)), ((), ())),
                                     precision=precision, preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, num_rows // block_n, body,
                          jnp.zeros(table.shape, jnp.float32))
  dtable_ref[...] = acc


def _whole(x):
  """A BlockSpec giving every program all of x."""
  return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _params(interpret):
  return None if interpret else plgpu_triton.CompilerParams(num_warps=_NUM_WARPS,
                                                            num_stages=_NUM_STAGES)


def forward(h, table, targets, *, vocab: int, precision, interpret: bool):
  """Per-row (log-sum-exp f32, target logit f32, first argmax int32), each [N].

  h [N, D], table [Vp, D] (padded as the module says), targets [N] int32 in [0, vocab).
  """
  n, width = h.shape
  rows = pl.BlockSpec((BLOCK_N, width), lambda i: (i, 0))
  row = pl.BlockSpec((BLOCK_N,), lambda i: (i,))
  kernel = functools.partial(_forward_kernel, vocab=vocab, precision=precision)
  return pl.pallas_call(
      kernel, grid=(n // BLOCK_N,), in_specs=[rows, _whole(table), row],
      out_specs=[row, row, row],
      out_shape=[jax.ShapeDtypeStruct((n,), jnp.float32)] * 2
      + [jax.ShapeDtypeStruct((n,), jnp.int32)],
      compiler_params=_params(interpret), interpret=interpret, name="head_loss_forward",
  )(h, table, targets)


def backward(h, table, targets, lse, weight, *, vocab: int, precision, interpret: bool):
  """(dh [N, D] in h's dtype, dtable [Vp, D] float32) of sum(weight * nll).

  weight [N] float32 (0 where a row does not count); lse from `forward`.
  """
  n, width = h.shape
  vp = table.shape[0]
  rows = pl.BlockSpec((BLOCK_N, width), lambda i: (i, 0))
  row = pl.BlockSpec((BLOCK_N,), lambda i: (i,))
  dh = pl.pallas_call(
      functools.partial(_dh_kernel, vocab=vocab, precision=precision),
      grid=(n // BLOCK_N,), in_specs=[rows, _whole(table), row, row, row], out_specs=rows,
      out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype),
      compiler_params=_params(interpret), interpret=interpret, name="head_loss_dh",
  )(h, table, targets, lse, weight)
  cols = pl.BlockSpec((BLOCK_V, width), lambda j: (j, 0))
  dtable = pl.pallas_call(
      functools.partial(_dtable_kernel, vocab=vocab, num_rows=n, precision=precision),
      grid=(vp // BLOCK_V,), in_specs=[_whole(h), cols, _whole(targets), _whole(lse),
                                       _whole(weight)],
      out_specs=cols, out_shape=jax.ShapeDtypeStruct((vp, width), jnp.float32),
      compiler_params=_params(interpret), interpret=interpret, name="head_loss_dtable",
  )(h, table, targets, lse, weight)
  return dh, dtable

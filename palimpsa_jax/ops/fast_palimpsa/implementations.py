"""The Fast Palimpsa implementations by name: one table, one contract.

Every entry of IMPLEMENTATIONS is called by `fast_palimpsa` as

    fn(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision,
       segment_starts, *, return_variance, chunk_size, interpret)
    -> (out [B, T, H, V] dtype of v, variance [B, T, H, V] float32 or None,
        mu [B, H, V, K] float32, precision [B, H, V, K] float32)

on validated arrays (the shapes of `palimpsa`'s table; prior_precision [H] float32,
segment_starts [B, T] bool or None) and computes in float32 whatever the input dtype.
The XLA forms ignore `interpret`; the GPU kernel ("pallas_gpu", KERNELS) runs interpreted
with it, may decline a call with NotImplementedError, and stays in the table as a function
raising KernelUnavailable where its module cannot be imported.
"""

import functools

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.fast_palimpsa.chunked import fast_palimpsa_chunked
from palimpsa_jax.ops.fast_palimpsa.reference import reference_fast_palimpsa
from palimpsa_jax.ops.palimpsa.implementations import unavailable
from palimpsa_jax.ops.palimpsa.types import PalimpsaState

try:
  from palimpsa_jax.ops.fast_palimpsa.gpu import fast_palimpsa_gpu
except ImportError as missing:
  fast_palimpsa_gpu = unavailable("pallas_gpu", missing)


def _f32(*xs):
  return tuple(x.astype(jnp.float32) for x in xs)


def sequential(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision,
               segment_starts, *, return_variance, chunk_size, interpret):
  """The literal loop over chunks and steps (reference.py) in float32."""
  del interpret
  # The reference restarts where the id changes; starts -> ids (a new id at every start).
  seg = None if segment_starts is None else jnp.cumsum(segment_starts, axis=1, dtype=jnp.int32)
  r = reference_fast_palimpsa(*_f32(q, k, v, beta, log_alpha), prior_precision,
                              initial_state=PalimpsaState(initial_mu, initial_precision),
                              segment_ids=seg, chunk_size=chunk_size)
  return (r.out.astype(v.dtype), r.variance if return_variance else None, r.state.mu,
          r.state.precision)


def chunked(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision,
            segment_starts, *, return_variance, chunk_size, interpret):
  """Matmuls over every chunk at once (chunked.py), in the linear form M = mu I, Ibar = I - Ip."""
  del interpret
  b, t = q.shape[:2]
  starts = jnp.zeros((b, t), bool) if segment_starts is None else segment_starts
  # Autodiff of the matmul form keeps a dozen float32 arrays per chunk, among them two V x K
  # states: the backward recomputes them (and the float32 casts) from the inputs instead, as
  # the GPU kernel does.
  return jax.checkpoint(functools.partial(_chunked, return_variance=return_variance,
                                          chunk_size=chunk_size))(
      q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision, starts)


def _chunked(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision, starts,
             *, return_variance, chunk_size):
  ipb = prior_precision[None, :, None, None]
  out, var, m, ibar = fast_palimpsa_chunked(
      *_f32(q, k, v, beta, log_alpha), starts, prior_precision, initial_mu * initial_precision,
      initial_precision - ipb, return_variance=return_variance, chunk_size=chunk_size)
  precision = ibar + ipb
  return out.astype(v.dtype), var, m / precision, precision


IMPLEMENTATIONS = {"chunked": chunked, "sequential": sequential, "pallas_gpu": fast_palimpsa_gpu}
# The kernels: run per device shard, may decline; "auto" tries them on an NVIDIA GPU.
KERNELS = ("pallas_gpu",)

"""The Fast Palimpsa implementations by name: one table, the contract of `palimpsa`'s
(ops.palimpsa_contract), and the order "auto" tries them in on each platform (ops.dispatch).

Every implementation computes in float32 whatever the input dtype. The XLA forms ignore
`interpret`; the GPU kernel ("pallas_gpu") runs interpreted with it, per device shard under
ops.kernel_sharding, supports a call where its package's `check_supported` passes, and stays
in the table supporting no call where its module cannot be imported.
"""

import functools

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.dispatch import ELSEWHERE, Implementation, declined, unavailable
from palimpsa_jax.ops.fast_palimpsa.chunked import fast_palimpsa_chunked
from palimpsa_jax.ops.fast_palimpsa.reference import reference_fast_palimpsa
from palimpsa_jax.ops.palimpsa_contract import PalimpsaState, kernel_layouts


def _gpu_supports(call):
  k, v, beta = call.args[1:4]
  return declined(fast_palimpsa_kernels.check_supported, k, v, beta,
                  call.options["chunk_size"], call.options["interpret"])


try:
  from palimpsa_jax.ops.fast_palimpsa.gpu import fast_palimpsa_gpu
  import pallas_kernels.fast_palimpsa_gpu as fast_palimpsa_kernels
  gpu_kernel = Implementation(fast_palimpsa_gpu, _gpu_supports, kernel_layouts)
except ImportError as missing:
  gpu_kernel = unavailable(missing, kernel_layouts)


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


IMPLEMENTATIONS = {"chunked": Implementation(chunked), "sequential": Implementation(sequential),
                   "pallas_gpu": gpu_kernel}
# What "auto" runs: on an NVIDIA GPU the kernel where it supports the call, else "chunked".
PREFERENCE = {"cuda": ("pallas_gpu", "chunked"), ELSEWHERE: ("chunked",)}

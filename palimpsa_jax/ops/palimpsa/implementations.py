"""The Palimpsa implementations by name: one table, one contract.

Every entry of IMPLEMENTATIONS is called by `palimpsa` as

    fn(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision,
       segment_starts, *, return_variance, chunk_size, interpret)
    -> (out [B, T, H, V] dtype of v, variance [B, T, H, V] float32 or None,
        mu [B, H, V, K] float32, precision [B, H, V, K] float32)

on validated arrays: q, k [B, T, H, K]; v, beta [B, T, H, V]; log_alpha [B, T, H];
prior_precision [H] float32; (initial_mu, initial_precision) [B, H, V, K] float32, the
state before step 0 in PalimpsaState's form; segment_starts [B, T] bool (True where the
state restarts from the prior) or None. Each builds its gates from log_alpha and
segment_starts with `pallas_kernels.common.step_gates`, in its own layout.

The XLA forms compute in the linear form (M = mu * I, Ibar = I - Ip, linear_form.py);
`_from_linear_form` is the one place that converts between the two state forms. The
Pallas kernels (KERNELS) run per device shard under ops.kernel_sharding and may decline a
call with NotImplementedError; a kernel whose module cannot be imported stays in the
table as a function that raises KernelUnavailable.
"""

import functools

import jax.numpy as jnp

from palimpsa_jax.ops.palimpsa.associative import palimpsa_associative
from palimpsa_jax.ops.palimpsa.chunked import palimpsa_chunked
from palimpsa_jax.ops.palimpsa.sequential import palimpsa_sequential
from pallas_kernels.common import step_gates


class KernelUnavailable(ImportError):
  """A kernel's module could not be imported (e.g. a jax without its Pallas backend)."""


def unavailable(name: str, error: ImportError):
  """An entry for a kernel whose import failed: raises KernelUnavailable when called."""

  def kernel(*args, **kwargs):
    del args, kwargs
    raise KernelUnavailable(f"implementation={name!r} cannot be imported: {error}") from error

  return kernel


# The GPU kernel's entries: each stage's kernel chosen per call ("auto"), or every stage on
# one Pallas backend.
GPU_BACKENDS = {"pallas_gpu": "auto", "pallas_gpu_triton": "triton",
                "pallas_gpu_mosaic": "mosaic"}
try:
  from pallas_kernels.palimpsa_gpu import palimpsa_gpu
  gpu_kernels = {name: functools.partial(palimpsa_gpu, backend=backend)
                 for name, backend in GPU_BACKENDS.items()}
except ImportError as missing:
  gpu_kernels = {name: unavailable(name, missing) for name in GPU_BACKENDS}
try:
  from pallas_kernels.palimpsa_tpu import palimpsa_tpu
except ImportError as missing:
  palimpsa_tpu = unavailable("pallas_tpu", missing)


def _from_linear_form(linear_fn):
  """The contract above around an XLA implementation of the linear form.

  linear_fn(q, k, v, beta, gate, prior_precision, m0, ibar0, *, return_variance,
  chunk_size) takes float32 inputs and the gate a_t [B, T, H] (0 at restarts) and
  returns (out, variance or None, M_T, Ibar_T).
  """

  @functools.wraps(linear_fn)
  def implementation(q, k, v, beta, log_alpha, prior_precision, initial_mu,
                     initial_precision, segment_starts, *, return_variance, chunk_size,
                     interpret):
    del interpret
    f32 = lambda x: x.astype(jnp.float32)
    ipb = prior_precision[None, :, None, None]
    starts = None if segment_starts is None else segment_starts[:, :, None]
    out, var, m, ibar = linear_fn(
        f32(q), f32(k), f32(v), f32(beta), step_gates(log_alpha, starts), prior_precision,
        initial_mu * initial_precision, initial_precision - ipb,
        return_variance=return_variance, chunk_size=chunk_size)
    precision = ibar + ipb
    return out.astype(v.dtype), var, m / precision, precision

  return implementation


IMPLEMENTATIONS = {
    "sequential": _from_linear_form(palimpsa_sequential),
    "associative": _from_linear_form(palimpsa_associative),
    "chunked": _from_linear_form(palimpsa_chunked),
    **gpu_kernels,
    "pallas_tpu": palimpsa_tpu,
}
# The Pallas kernels: run per device shard, may decline, "auto" picks one per backend.
KERNELS = (*GPU_BACKENDS, "pallas_tpu")

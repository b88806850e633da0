"""The Palimpsa implementations by name: one table, one contract (ops.palimpsa_contract), and
the order "auto" tries them in on each platform (ops.dispatch).

Each builds its gates from log_alpha and segment_starts with `pallas_kernels.common.step_gates`,
in its own layout. The XLA forms compute in the linear form (M = mu * I, Ibar = I - Ip,
ops.linear_form); `_from_linear_form` is the one place that converts between the two state
forms. The Pallas kernels run per device shard under ops.kernel_sharding and support a call
where their package's `check_supported` passes; a kernel whose module cannot be imported stays
in the table, supporting no call.
"""

import functools

import jax.numpy as jnp

from palimpsa_jax.ops.dispatch import ELSEWHERE, Implementation, declined, unavailable
from palimpsa_jax.ops.palimpsa.associative import palimpsa_associative
from palimpsa_jax.ops.palimpsa.chunked import palimpsa_chunked
from palimpsa_jax.ops.palimpsa.sequential import palimpsa_sequential
from palimpsa_jax.ops.palimpsa_contract import kernel_layouts
from pallas_kernels.common import step_gates

# The GPU kernel's entries: each stage's kernel chosen per call ("auto"), or every stage on
# one Pallas backend.
GPU_BACKENDS = {"pallas_gpu": "auto", "pallas_gpu_triton": "triton",
                "pallas_gpu_mosaic": "mosaic"}


def _gpu_kernel(backend: str) -> Implementation:
  """The palimpsa_gpu entry that runs its stages under `backend`."""

  def supports(call):
    return declined(palimpsa_gpu.check_supported, *call.args[:6], backend=backend,
                    **call.options)

  return Implementation(functools.partial(palimpsa_gpu.palimpsa_gpu, backend=backend),
                        supports, kernel_layouts)


def _tpu_kernel() -> Implementation:
  def supports(call):
    q, v = call.args[0], call.args[2]
    return declined(palimpsa_tpu.check_supported, q, v, chunk_size=call.options["chunk_size"],
                    interpret=call.options["interpret"])

  return Implementation(palimpsa_tpu.palimpsa_tpu, supports, kernel_layouts)


try:
  from pallas_kernels import palimpsa_gpu
  gpu_kernels = {name: _gpu_kernel(backend) for name, backend in GPU_BACKENDS.items()}
except ImportError as missing:
  gpu_kernels = {name: unavailable(missing, kernel_layouts) for name in GPU_BACKENDS}
try:
  from pallas_kernels import palimpsa_tpu
  tpu_kernel = _tpu_kernel()
except ImportError as missing:
  tpu_kernel = unavailable(missing, kernel_layouts)


def _from_linear_form(linear_fn):
  """The contract around an XLA implementation of the linear form.

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

  return Implementation(implementation)


IMPLEMENTATIONS = {
    "sequential": _from_linear_form(palimpsa_sequential),
    "associative": _from_linear_form(palimpsa_associative),
    "chunked": _from_linear_form(palimpsa_chunked),
    **gpu_kernels,
    "pallas_tpu": tpu_kernel,
}
# What "auto" runs: the platform's kernel where it supports the call, else "chunked".
PREFERENCE = {"cuda": ("pallas_gpu", "chunked"), "tpu": ("pallas_tpu", "chunked"),
              ELSEWHERE: ("chunked",)}

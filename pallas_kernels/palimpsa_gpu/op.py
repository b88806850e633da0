"""Exact Palimpsa on NVIDIA GPUs: chunk-boundary matmuls + Pallas chunk walks.

Forward: (1) one Pallas kernel per (batch*head, V-tile, K-part, M or Ibar) adds each
chunk's write to the linear state (M = mu*I, Ibar = I - Ip) as tensor-core matmuls,
sequentially over chunks, giving the chunk-boundary states; (2) a Pallas kernel over
(batch*head, chunk, V-tile) walks the chunk's steps, dividing and reading out at every
step. Both read the inputs in the caller's [B, T, H, D] layout. The backward keeps only
the op's arguments (and the variance it returned): it recomputes the gates and runs the
boundary kernel again once the output's cotangent exists (the boundary states alone are
2 * V * K floats per chunk of every batch-head: 37 KB a token at Palimpsa-D 760M's shape
with 64-step chunks).
Backward: recompute sub-chunk states and walk each chunk in reverse (Pallas, one
[16, 16] state tile per Triton program or per warp of a Mosaic GPU warpgroup, the tiles'
sums added by TMA reduce-add or by XLA) with zero adjoint from later chunks, scan the
adjoint carries over chunks (Pallas), add the carries' contributions as matmuls (XLA);
dlog_alpha from the identity
dL/dlog a_t = sum_{u >= t, same segment} (<dM_u^loc, M_u> + <dI_u^loc, Ibar_u>
                                          - v_u . dv_u - beta_u . dbeta_u).
"""

import functools

import jax

from pallas_kernels.palimpsa_gpu.backward import backward
from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig, check_config
from pallas_kernels.palimpsa_gpu.forward import forward
from pallas_kernels.palimpsa_gpu.stages import make_config


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _palimpsa(cfg, q, k, v, beta, log_alpha, prior_precision, initial_mu,
              initial_precision, starts):
  return forward(cfg, q, k, v, beta, log_alpha, prior_precision, initial_mu,
                 initial_precision, starts)


def _palimpsa_fwd(cfg, *args):
  """The outputs, and the residuals: the arguments themselves and the variance (None
  without it). Nothing else the forward computes is kept (layout copies, gates, boundary
  and final states): the backward recomputes it for less than keeping it costs."""
  outputs = forward(cfg, *args)
  return outputs, (*args, outputs[1])


def _palimpsa_bwd(cfg, saved, cotangents):
  # The barrier makes the recomputation wait for the output's cotangent: in an unrolled
  # program XLA would otherwise merge it with the forward's identical kernel call and keep
  # the forward's states alive until here.
  d_out, saved = jax.lax.optimization_barrier((cotangents[0], saved))
  return backward(cfg, saved, (d_out, *cotangents[1:])) + (None,)


_palimpsa.defvjp(_palimpsa_fwd, _palimpsa_bwd)


def _check_nvidia_gpu() -> None:
  """The compiled kernels use Triton with inline PTX: NVIDIA GPUs only."""
  device = jax.devices()[0]
  if device.platform != "gpu" or "rocm" in device.client.platform_version.lower():
    raise NotImplementedError(
        "palimpsa_gpu needs an NVIDIA GPU as the default device (or interpret=True); "
        f"got {device.platform!r} ({device.client.platform_version})")


def check_supported(q, k, v, beta, log_alpha, prior_precision, *, return_variance: bool,
                    chunk_size: int, interpret: bool, backend: str = "auto") -> GpuKernelConfig:
  """The call's config (`make_config`); raises NotImplementedError with the reason where
  palimpsa_gpu cannot run the call (arguments as palimpsa_gpu's)."""
  if not interpret:
    _check_nvidia_gpu()
  return make_config(q, v, log_alpha, prior_precision, return_variance=return_variance,
                     chunk_size=chunk_size, interpret=interpret, k_dtype=k.dtype,
                     beta_dtype=beta.dtype, backend=backend)


def palimpsa_gpu(q, k, v, beta, log_alpha, prior_precision, initial_mu,
                 initial_precision, segment_starts, *, return_variance: bool,
                 chunk_size: int, interpret: bool, backend: str = "auto",
                 config: GpuKernelConfig | None = None):
  """Exact Palimpsa (docs/math.md) with Pallas GPU kernels; differentiable.

  Args:
    q, k: [B, T, H, K]; v, beta: [B, T, H, V] (beta >= 0); log_alpha: [B, T, H]
      (<= 0); prior_precision: [H] (> 0); initial_mu, initial_precision:
      [B, H, V, K] float32; segment_starts: [B, T] bool (True where the state restarts
      from the prior) or None.
    return_variance: also return sum_k q^2 / I_t.
    chunk_size: chunk length of the two-level scheme: min(chunk_size, T) rounded up to a
      power of two, then clamped to [16, 128].
    interpret: run the Pallas kernels in interpret mode (CPU).
    backend: "auto" (each stage's Mosaic GPU kernel where it runs the call, else its
      Triton kernel), "triton" or "mosaic" (every stage on that backend).
    config: the kernels' tiles; None picks them with `make_config`. A given config must
      have been made for these arguments (its call fields are checked).

  Returns:
    (out [B, T, H, V] dtype of v, variance [B, T, H, V] f32 or None,
     mu_final [B, H, V, K] f32, precision_final [B, H, V, K] f32).

  Raises:
    NotImplementedError: K or V larger than 256, a compiled call (interpret=False)
      without an NVIDIA GPU as the default backend, or backend="mosaic" where a stage's
      Mosaic GPU kernel cannot run the call.
    ValueError: an unknown backend, a backend and a config both given, or a config whose
      call fields do not match the call.
  """
  if config is not None and backend != "auto":
    raise ValueError(f"give backend or config, not both (backend={backend!r}): a config "
                     "names each stage's kernel itself")
  expected = check_supported(q, k, v, beta, log_alpha, prior_precision,
                             return_variance=return_variance, chunk_size=chunk_size,
                             interpret=interpret, backend=backend)
  if config is None:
    config = expected
  else:
    check_config(config, expected)
  return _palimpsa(config, q, k, v, beta, log_alpha, prior_precision, initial_mu,
                   initial_precision, segment_starts)

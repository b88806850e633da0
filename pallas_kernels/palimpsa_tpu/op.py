"""`palimpsa_tpu`: the op-level entry point, a custom_vjp around the Mosaic TPU kernels."""

import functools

import jax
import jax.extend as jex
from jax.experimental.pallas import tpu as pltpu
from jax.interpreters import batching
from jax.interpreters import mlir
import jax.numpy as jnp

from pallas_kernels.common import step_gates
from pallas_kernels.palimpsa_tpu import layout
from pallas_kernels.palimpsa_tpu.backward import backward
from pallas_kernels.palimpsa_tpu.forward import boundary_states, walk_outputs


def _gates(log_alpha, starts, g: layout.Geometry):
  """Per-step gate alpha_t and in-chunk write weight w_t, both [N, 1, Tp] float32.

  alpha_t is 0 where a segment starts (restart from the prior: M = 0, Ibar = 0) and 1 on
  padded steps; w_t = prod_{s > t in t's chunk} alpha_s.
  """
  la = layout.steps_to_kernel(log_alpha, g, 0.0)                 # [N, 1, Tp]
  if starts is None:
    reset = jnp.zeros_like(la, dtype=bool)
  else:
    change = jnp.broadcast_to(starts[:, :, None], log_alpha.shape)
    reset = layout.steps_to_kernel(change, g, 0.0) > 0
  gate = step_gates(la, reset)
  chunks = lambda x: x.reshape(g.n, g.num_chunks, g.chunk)
  la_c, reset_c = chunks(la), chunks(reset)
  later = jnp.cumsum(la_c[..., ::-1], axis=-1)[..., ::-1] - la_c   # sum over s > t in chunk
  reset_later = jnp.cumsum(reset_c[..., ::-1].astype(jnp.int32), axis=-1)[..., ::-1] - reset_c
  w = jnp.where(reset_later > 0, 0.0, jnp.exp(later))
  return gate, w.reshape(g.n, 1, g.tp)


def _prepare(q, k, v, beta, log_alpha, prior_precision, segment_starts, chunk_size,
             interpret):
  g = layout.geometry(q.shape, v.shape[-1], chunk_size, short_chunks=bool(interpret))
  gate, w = _gates(log_alpha, segment_starts, g)
  inputs = dict(q_t=layout.keys_to_kernel(q, g), k_t=layout.keys_to_kernel(k, g),
                v=layout.values_to_kernel(v, g), beta=layout.values_to_kernel(beta, g),
                gate=gate, ip=layout.prior_to_kernel(prior_precision, g))
  return g, inputs, w


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def _palimpsa_tpu(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision,
                  segment_starts, return_variance, chunk_size, interpret):
  outputs, _ = _forward(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision,
                        segment_starts, return_variance, chunk_size, interpret)
  return outputs


def _forward(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision,
             segment_starts, return_variance, chunk_size, interpret):
  """Kernel outputs and the residuals of the backward (inputs, chunk-start and final states)."""
  if not interpret:
    q = _lowers_only_for_tpu.bind(q)
  g, x, w = _prepare(q, k, v, beta, log_alpha, prior_precision, segment_starts, chunk_size,
                     interpret)
  ip_state = prior_precision.astype(jnp.float32)[None, :, None, None]
  mu0 = initial_mu.astype(jnp.float32)
  prec0 = initial_precision.astype(jnp.float32)
  m0 = layout.state_to_kernel(mu0 * prec0, g)
  ibar0 = layout.state_to_kernel(prec0 - ip_state, g)
  m_start, ibar_start, m_end, ibar_end = boundary_states(
      x["k_t"], x["v"], x["beta"], w, x["gate"], m0, ibar0, g, interpret)
  out, var = walk_outputs(x["q_t"], x["k_t"], x["v"], x["beta"], x["gate"], x["ip"], m_start,
                          ibar_start, g, return_variance, interpret)
  prec_end = layout.state_from_kernel(ibar_end, g) + ip_state
  mu_end = layout.state_from_kernel(m_end, g) / prec_end
  out = layout.values_from_kernel(out, g).astype(v.dtype)
  if var is not None:
    var = layout.values_from_kernel(var, g)
  residuals = (q, k, v, beta, log_alpha, prior_precision, mu0, prec0, segment_starts, m_start,
               ibar_start, mu_end, prec_end)
  return (out, var, mu_end, prec_end), residuals


def _bwd(return_variance, chunk_size, interpret, residuals, cotangents):
  (q, k, v, beta, log_alpha, prior_precision, mu0, prec0, segment_starts, m_start, ibar_start,
   mu_end, prec_end) = residuals
  d_out, d_var, d_mu_end, d_prec_end = cotangents
  g, x, _ = _prepare(q, k, v, beta, log_alpha, prior_precision, segment_starts, chunk_size,
                     interpret)
  # Final state: mu_T = M_T / (Ibar_T + Ip), I_T = Ibar_T + Ip.
  r_end = 1.0 / prec_end
  lam_m_end = d_mu_end * r_end
  lam_i_end = d_prec_end - d_mu_end * mu_end * r_end
  dvar = None if not return_variance else layout.values_to_kernel(d_var, g)
  dq_t, dk_t, dv, dbeta, dgate, lam_m0, lam_i0, dip = backward(
      x["q_t"], x["k_t"], x["v"], x["beta"], x["gate"], x["ip"], m_start, ibar_start,
      layout.state_to_kernel(lam_m_end, g), layout.state_to_kernel(lam_i_end, g),
      layout.values_to_kernel(d_out, g), dvar, g, interpret)
  lam_m0 = layout.state_from_kernel(lam_m0, g)
  lam_i0 = layout.state_from_kernel(lam_i0, g)
  # Initial state: M_0 = mu_0 I_0, Ibar_0 = I_0 - Ip.
  d_mu0 = lam_m0 * prec0
  d_prec0 = lam_m0 * mu0 + lam_i0
  dip_steps = jnp.sum(dip[:, :g.kd, :g.vd].reshape(g.batch, g.heads, -1), axis=(0, 2))
  d_ip = dip_steps + jnp.sum(lam_i_end - lam_i0, axis=(0, 2, 3))
  seg_ct = (None if segment_starts is None
            else jnp.zeros(segment_starts.shape, jax.dtypes.float0))
  return (layout.keys_from_kernel(jnp.sum(dq_t, axis=1), g).astype(q.dtype),
          layout.keys_from_kernel(jnp.sum(dk_t, axis=1), g).astype(k.dtype),
          layout.values_from_kernel(dv, g).astype(v.dtype),
          layout.values_from_kernel(dbeta, g).astype(beta.dtype),
          layout.steps_from_kernel(jnp.sum(dgate, axis=1), g).astype(log_alpha.dtype),
          d_ip.astype(prior_precision.dtype),
          d_mu0, d_prec0, seg_ct)


_palimpsa_tpu.defvjp(_forward, _bwd)


# The identity, whose lowering decides where the compiled kernels may go: for TPU it lowers to
# nothing, for any other platform it raises. So jit / jax.export / AOT lowering for TPU works from
# a host of any kind, while lowering the compiled kernels for CPU or GPU fails with a clear message.
_lowers_only_for_tpu = jex.core.Primitive("palimpsa_tpu_lowers_only_for_tpu")
_lowers_only_for_tpu.def_impl(lambda x: x)
_lowers_only_for_tpu.def_abstract_eval(lambda x: x)
batching.primitive_batchers[_lowers_only_for_tpu] = (
    lambda args, dims: (_lowers_only_for_tpu.bind(*args), dims[0]))
mlir.register_lowering(_lowers_only_for_tpu, lambda ctx, x: [x], platform="tpu")


def _refuse_lowering(ctx, x):
  del x
  raise NotImplementedError(
      "palimpsa_tpu's compiled kernels lower only for TPU (or use interpret=True); this "
      f"computation is being lowered for {ctx.module_context.platforms}")


mlir.register_lowering(_lowers_only_for_tpu, _refuse_lowering)


def _check_tpu() -> None:
  """An eager compiled call runs on the default device, which must then be a TPU."""
  platform = jax.devices()[0].platform
  if platform != "tpu":
    raise NotImplementedError(
        f"palimpsa_tpu needs a TPU as the default device (or interpret=True); got {platform!r}")


def check_supported(q, v, *, chunk_size: int, interpret) -> None:
  """Raises NotImplementedError with the reason where palimpsa_tpu cannot run the call (q
  [B, T, H, K], v [B, T, H, V]; the rest as palimpsa_tpu's)."""
  if not interpret and not isinstance(q, jax.core.Tracer):
    _check_tpu()
  layout.geometry(q.shape, v.shape[-1], chunk_size)


def palimpsa_tpu(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision,
                 segment_starts, *, return_variance: bool, chunk_size: int,
                 interpret: bool | pltpu.InterpretParams):
  """Exact Palimpsa on TPU (Pallas Mosaic); differentiable w.r.t. every float input.

  Args:
    q, k: [B, T, H, K] (K <= 256); v, beta: [B, T, H, V]; log_alpha: [B, T, H];
    prior_precision: [H]; initial_mu, initial_precision: [B, H, V, K] float32;
    segment_starts: [B, T] bool or None (True where the state restarts from the prior).
    return_variance: also return sum_k q^2 / I_t.
    chunk_size: time block (> 0, checked by `palimpsa`), rounded up to the 128-lane width
      (interpreted: the whole sequence if shorter).
    interpret: True runs the kernels in the Pallas interpreter (any backend, for tests); a
      `pltpu.InterpretParams` selects the TPU interpret mode (simulated VMEM, cores and grid
      order).

  Returns:
    (out [B,T,H,V] dtype of v, variance [B,T,H,V] float32 or None, mu [B,H,V,K] float32,
     precision [B,H,V,K] float32).

  Raises:
    NotImplementedError: K > 256, or an eager compiled call (interpret=False) without a TPU as
      the default device ("auto" then falls back to "chunked"). Under a trace (jit, export) the
      lowering platform decides: lowering for TPU works from any host, lowering for another
      platform raises NotImplementedError then.
  """
  check_supported(q, v, chunk_size=chunk_size, interpret=interpret)
  return _palimpsa_tpu(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision,
                       segment_starts, return_variance, chunk_size, interpret)

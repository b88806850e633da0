"""Fast Palimpsa's GPU kernel (implementation="pallas_gpu") against the float64 reference:
interpreted on CPU, and the same checks compiled on a Hopper GPU (-m gpu)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from palimpsa_jax.ops import fast_palimpsa
from palimpsa_jax.ops.fast_palimpsa.gpu import fast_palimpsa_gpu
from tests.ops.fast_palimpsa.fast_palimpsa_suite import check_against_reference
from tests.ops.numerics import BFLOAT16_TOL, FLOAT32_TOL, GRAD_TOL, assert_close_to_reference
from tests.ops.palimpsa.palimpsa_suite import make_inputs

# (B, T, H, K, V), chunk_size, segment lengths per row (None: no segment ids). Interpreted
# kernels are slow on CPU: small shapes. The first has three 16-step chunks (the last
# padded), restarts inside a chunk and on a chunk boundary, V of 20 (padded to 32); in
# bfloat16 its reads run on the fused kernels (four chunks a CTA), in float32 as XLA's
# matmuls. The others: chunks of 32 and of 64 (one a CTA) with restarts.
SMALL = (((2, 37, 2, 8, 20), 16, ((10, 6, 21), (37,))),
         ((1, 45, 1, 16, 8), 32, None),
         ((1, 100, 2, 16, 24), 64, ((30, 70),)))
# Compiled: the small shapes, then D170-like and D760-like heads with T not a multiple of C
# (both dtypes), and in bfloat16 (the fused reads) D760-, K128- and MQAR-like heads.
LARGE = SMALL + (((2, 300, 3, 48, 48), 64, ((100, 150, 50), (300,))),
                 ((1, 200, 2, 96, 192), 16, None))
LARGE_BF16 = (((2, 300, 3, 96, 192), 64, ((100, 150, 50), (300,))),
              ((2, 256, 2, 96, 192), 32, None),
              ((1, 256, 2, 128, 128), 64, None),
              ((4, 512, 4, 16, 32), 64, None))
FLOAT32, BFLOAT16 = (jnp.float32, FLOAT32_TOL, GRAD_TOL), (jnp.bfloat16, BFLOAT16_TOL,
                                                          BFLOAT16_TOL)


def _cases(shapes, interpret, marks=(), dtypes=(FLOAT32, BFLOAT16)):
  return [pytest.param(shape, chunk, lengths, dtype, fwd, grad, interpret, marks=marks,
                       id=f"{'interpreted' if interpret else 'compiled'}-{shape}-"
                          f"{jnp.dtype(dtype).name}")
          for shape, chunk, lengths in shapes for dtype, fwd, grad in dtypes]


@pytest.mark.parametrize(
    "shape, chunk, lengths, dtype, fwd_tol, grad_tol, interpret",
    _cases(SMALL[:1], True) + _cases(SMALL[1:], True, pytest.mark.slow)
    + _cases(LARGE, False, pytest.mark.gpu)
    + _cases(LARGE_BF16, False, pytest.mark.gpu, (BFLOAT16,)))
def test_matches_the_float64_reference(shape, chunk, lengths, dtype, fwd_tol, grad_tol,
                                       interpret):
  """Output, variance, final state and every gradient (initial state included)."""
  check_against_reference("pallas_gpu", 70, shape, chunk, lengths, dtype, fwd_tol, grad_tol,
                          interpret=interpret)


def _args(shape, dtype=jnp.float32):
  x = make_inputs(71, shape)
  names = ("q", "k", "v", "beta", "log_alpha", "prior_precision", "mu0", "precision0")
  return [jnp.asarray(x[n], dtype if i < 4 else jnp.float32) for i, n in enumerate(names)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_saves_only_the_inputs_for_the_backward(dtype):
  """The residuals kept between forward and backward are the inputs (segment starts
  included) and at most the final state: nothing of the size of the chunk states
  [B, H, T/C, V, K] (here 4 times q's size), with either form of the reads."""
  b, t, h, kd, vd = shape = (1, 64, 1, 16, 16)
  args = _args(shape, dtype)
  fn = functools.partial(fast_palimpsa_gpu, segment_starts=None, return_variance=False,
                         chunk_size=16, interpret=True)
  _, vjp = jax.vjp(lambda *a: fn(*a)[0], *args)
  residuals = [x for x in jax.tree.leaves(vjp) if hasattr(x, "size")]
  assert residuals
  assert max(x.size for x in residuals) <= b * t * h * max(kd, vd)
  inputs = sum(x.size for x in args) + b * t
  assert sum(x.size for x in residuals) <= inputs + 2 * b * h * vd * kd


def test_declines_an_unsupported_chunk_and_auto_falls_back():
  args = _args((1, 20, 1, 4, 4))
  with pytest.raises(ValueError, match="pallas_gpu.*chunks of 16, 32, 64 or 128"):
    fast_palimpsa(*args[:6], implementation="pallas_gpu", chunk_size=8, interpret=True)
  with pytest.raises(ValueError, match="pallas_gpu.*Hopper"):
    fast_palimpsa(*args[:6], implementation="pallas_gpu", chunk_size=16)
  # On a CPU host "auto" is the XLA chunked form.
  auto = jax.jit(functools.partial(fast_palimpsa, chunk_size=8))(*args[:6])
  chunked = jax.jit(functools.partial(fast_palimpsa, chunk_size=8,
                                      implementation="chunked"))(*args[:6])
  assert jnp.array_equal(auto.out, chunked.out)


def test_auto_runs_the_kernel_on_an_nvidia_gpu(monkeypatch):
  """implementation="auto" calls the kernel where the backend is CUDA (faked here, the kernel
  interpreted); a chunk the kernel does not support falls back to "chunked"."""
  from palimpsa_jax.ops import dispatch
  from palimpsa_jax.ops.fast_palimpsa import implementations
  calls = []

  def counted(*args, **kwargs):
    calls.append(kwargs["chunk_size"])
    return fast_palimpsa_gpu(*args, **kwargs)

  monkeypatch.setattr(dispatch, "platform", lambda: "cuda")
  entry = implementations.IMPLEMENTATIONS["pallas_gpu"]
  monkeypatch.setitem(implementations.IMPLEMENTATIONS, "pallas_gpu",
                      dataclasses.replace(entry, fn=counted))
  args = _args((1, 20, 1, 4, 4))[:6]
  for chunk in (16, 8):
    auto = fast_palimpsa(*args, chunk_size=chunk, interpret=True)
    chunked = fast_palimpsa(*args, chunk_size=chunk, implementation="chunked")
    assert_close_to_reference(auto, chunked, FLOAT32_TOL)
  assert calls == [16]


@pytest.mark.gpu
def test_auto_is_the_kernel_on_a_hopper_gpu():
  args = _args((2, 100, 2, 16, 32))[:6]
  run = lambda impl: jax.jit(functools.partial(fast_palimpsa, implementation=impl))(*args)
  auto, kernel = run("auto"), run("pallas_gpu")
  assert all(jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(auto),
                                                   jax.tree.leaves(kernel)))


KERNEL_NAMES = ("palimpsa_boundary_mosaic", "fast_palimpsa_reads_forward",
                "fast_palimpsa_reads_backward_v", "fast_palimpsa_reads_backward_k",
                "palimpsa_adjoint_carries_mosaic")
FUSED = ["palimpsa_boundary_mosaic"] * 2 + [
    "fast_palimpsa_reads_forward", "fast_palimpsa_reads_backward_v",
    "fast_palimpsa_reads_backward_k", "palimpsa_adjoint_carries_mosaic"]
XLA_READS = ["palimpsa_boundary_mosaic"] * 2 + ["palimpsa_adjoint_carries_mosaic"]


def mosaic_kernels(text: str) -> list[str]:
  """The kernel of every Mosaic GPU custom call in lowered StableHLO text, by name."""
  calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
  return sorted(next(name for name in KERNEL_NAMES if name in line) for line in calls)


# (B, T, H, K, V) chunk, variance, dtype, the kernels: D760, D170, K128 and MQAR heads in
# bfloat16 (the fused reads; D760 also at C = 32 and 16), the interpreted tests' padded
# shape in float32 (T not a multiple of the chunk, segments, the variance: XLA's reads),
# then every shape the compiled tests above run in bfloat16, with the variance (lowering
# raises what the GPU would refuse: shared memory, TMA copies' widths and sizes).
@pytest.mark.parametrize("shape, chunk, with_var, dtype, kernels", [
    ((4, 4096, 16, 96, 192), 64, False, jnp.bfloat16, FUSED),
    ((4, 4096, 16, 96, 192), 32, False, jnp.bfloat16, FUSED),
    ((4, 4096, 16, 48, 48), 64, True, jnp.bfloat16, FUSED),
    ((4, 4096, 16, 128, 128), 64, False, jnp.bfloat16, FUSED),
    ((64, 1024, 8, 16, 32), 64, False, jnp.bfloat16, FUSED),
    ((2, 1024, 8, 16, 32), 16, True, jnp.bfloat16, FUSED),
    ((4, 4096, 16, 96, 192), 16, False, jnp.bfloat16, FUSED),
    ((2, 37, 2, 8, 20), 32, True, jnp.float32, XLA_READS)] + [
    (shape, chunk, True, jnp.bfloat16, FUSED) for shape, chunk, _ in LARGE + LARGE_BF16])
def test_lowers_to_mosaic_gpu_only(monkeypatch, shape, chunk, with_var, dtype, kernels):
  """A compiled forward+backward lowers for sm_90 on a CPU host to Mosaic GPU kernels only
  (nothing through Pallas' deprecated Triton lowering): the forward's boundary kernel and
  read kernel, the backward's boundary kernel (the recomputation: its read kernel's output
  is unused, and dropped), read kernel and carries."""
  from pallas_kernels.fast_palimpsa_gpu import support
  monkeypatch.setattr(support, "hopper_available", lambda: True)
  b, t, h, kd, vd = shape
  sds, f32 = jax.ShapeDtypeStruct, jnp.float32
  args = [sds((b, t, h, kd), dtype)] * 2 + [sds((b, t, h, vd), dtype)] * 2 + [
      sds((b, t, h), f32), sds((h,), f32)] + [sds((b, h, vd, kd), f32)] * 2
  starts = sds((b, t), jnp.bool_)

  def loss(*a):
    out, var, mu, prec = fast_palimpsa_gpu(*a[:8], a[8], return_variance=with_var,
                                           chunk_size=chunk)
    total = jnp.sum(out.astype(f32)) + jnp.sum(mu) + jnp.sum(prec)
    return total + jnp.sum(var) if with_var else total

  grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(8))))
  text = grad.trace(*args, starts).lower(lowering_platforms=("cuda",)).as_text()
  assert mosaic_kernels(text) == sorted(kernels) and "triton" not in text.lower()

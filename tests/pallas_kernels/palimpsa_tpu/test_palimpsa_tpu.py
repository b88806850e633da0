"""Pallas Mosaic TPU kernel: the op suite interpreted on CPU, and every kernel lowered for TPU.

Lowering (`.lower(lowering_platforms=("tpu",))`) runs JAX's Pallas -> Mosaic lowering on this
machine: block-shape rules, supported primitives and the Mosaic MLIR verifier. It does not run
Mosaic's own compiler (that lives in libtpu), so a TPU compile is not verified here: docs/tpu.md.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from palimpsa_jax.ops import PalimpsaState, palimpsa
from palimpsa_jax.ops.common import segment_starts
from pallas_kernels.palimpsa_tpu import palimpsa_tpu
from pallas_kernels.palimpsa_tpu.layout import geometry
from tests.ops.numerics import FLOAT32_TOL, assert_close_to_reference
from tests.ops.palimpsa.palimpsa_suite import (DIFF_ARGS, GRADS, RESULTS, PalimpsaSuite, make_inputs,
                                     random_cotangents, reference_with_grads)

HEAD_DIMS = (16, 32, 48, 64, 96, 128, 192, 256)


class TestPallasTpuInterpret(PalimpsaSuite):
  IMPLEMENTATION = "pallas_tpu"
  INTERPRET = True
  LONG_RUN = False
  SHAPES = PalimpsaSuite.SHAPES + (
      # Two 128-step chunks, two value tiles; resets inside a chunk and at a chunk start.
      ((1, 140, 1, 16, 130), 64, ((50, 78, 12),)),
  )


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="compiled Mosaic kernels need a TPU")
class TestPallasTpuCompiled(PalimpsaSuite):
  IMPLEMENTATION = "pallas_tpu"
  SHAPES = TestPallasTpuInterpret.SHAPES


def _check_kernel(shape, lengths, interpret, return_variance=True):
  """Kernel result and grads (called directly) against the float64 reference."""
  x = make_inputs(5, shape, segment_lengths=lengths)
  cts = random_cotangents(6, shape)
  if not return_variance:
    cts = (cts[0], np.zeros_like(cts[1])) + cts[2:]
  seg = jnp.asarray(x["segment_ids"])
  starts = segment_starts(seg, *seg.shape)
  kernel = functools.partial(palimpsa_tpu, segment_starts=starts,
                             return_variance=return_variance, chunk_size=64, interpret=interpret)
  res, vjp = jax.vjp(kernel, *(jnp.asarray(x[n]) for n in DIFF_ARGS))
  kernel_cts = tuple(None if r is None else jnp.asarray(c, jnp.float32) for c, r in zip(cts, res))
  grads = vjp(kernel_cts)
  ref_res, ref_grads = reference_with_grads(x, cts)
  present = [(name, got, want) for name, got, want in
             zip(RESULTS + GRADS, res + grads, ref_res + ref_grads) if got is not None]
  assert_close_to_reference({name: got for name, got, _ in present},
                            {name: want for name, _, want in present}, FLOAT32_TOL)


def test_without_variance_matches_reference():
  """return_variance=False: the backward kernel's branch without the variance cotangent."""
  _check_kernel((1, 150, 1, 16, 8), ((40, 110),), True, return_variance=False)


def test_tpu_interpret_mode_two_cores_shuffled_grid():
  """Simulated VMEM (scratch starts as NaN), two TensorCores, parallel grid axes shuffled."""
  params = pltpu.InterpretParams(random_seed=0, num_cores_or_threads=2)
  _check_kernel((1, 20, 2, 16, 8), ((7, 13),), params)


@pytest.mark.slow
def test_tpu_interpret_mode_race_detector_several_chunks():
  """Two chunks and two value tiles under the race detector (about 5 CPU minutes)."""
  params = pltpu.InterpretParams(random_seed=1, num_cores_or_threads=2, detect_races=True)
  _check_kernel((1, 150, 2, 16, 130), ((60, 90),), params)
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # pylint: disable=g-import-not-at-top
  assert not interpret_pallas_call.races.races_found


def _abstract_args(kd, vd, dtype, t):
  s = jax.ShapeDtypeStruct
  b, h = 1, 2
  return (s((b, t, h, kd), dtype), s((b, t, h, kd), dtype), s((b, t, h, vd), dtype),
          s((b, t, h, vd), dtype), s((b, t, h), jnp.float32), s((h,), jnp.float32),
          s((b, h, vd, kd), jnp.float32), s((b, h, vd, kd), jnp.float32), s((b, t), jnp.bool_))


def _compiled_kernel(*args, return_variance, chunk_size):
  """The compiled kernels, traced (under a trace palimpsa_tpu leaves the device to the
  lowering platform), to lower them for TPU here."""
  return palimpsa_tpu(*args, return_variance=return_variance, chunk_size=chunk_size,
                      interpret=False)


def _lower_for_tpu(kd, vd, dtype, return_variance, t=16):
  """StableHLO text of forward + backward lowered for TPU."""

  def loss(*args):
    out, var, mu, prec = _compiled_kernel(*args, return_variance=return_variance, chunk_size=64)
    total = jnp.sum(out.astype(jnp.float32)) + jnp.sum(mu) + jnp.sum(prec)
    return total + (jnp.sum(var) if return_variance else 0.0)

  grad = jax.jit(jax.grad(loss, argnums=tuple(range(8))))
  lowered = grad.trace(*_abstract_args(kd, vd, dtype, t)).lower(lowering_platforms=("tpu",))
  return lowered.as_text()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dim", HEAD_DIMS)
def test_kernels_lower_for_tpu(dim, dtype):
  # boundary states + walk (forward) and the backward kernel.
  assert _lower_for_tpu(dim, dim, dtype, return_variance=True).count("tpu_custom_call") == 3


@pytest.mark.parametrize("kd,vd", [(16, 32), (48, 96), (96, 192), (128, 256), (256, 16)])
def test_kernels_lower_for_tpu_without_variance_and_several_chunks(kd, vd):
  text = _lower_for_tpu(kd, vd, jnp.bfloat16, return_variance=False, t=300)
  assert text.count("tpu_custom_call") == 3


def test_exports_for_tpu():
  """jax.export with platforms=["tpu"] (value and grads): all three kernels, by name."""

  def loss(*args):
    out, _, mu, _ = _compiled_kernel(*args, return_variance=False, chunk_size=128)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(mu)

  value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5, 6, 7))
  exported = jax.export.export(jax.jit(value_and_grad), platforms=["tpu"])(
      *_abstract_args(96, 192, jnp.bfloat16, 260))
  assert exported.platforms == ("tpu",)
  text = exported.mlir_module()
  for kernel in ("boundary_states", "walk", "backward"):
    assert f'kernel_name = "palimpsa_tpu_{kernel}"' in text


def test_public_op_exports_for_tpu_from_any_host():
  """The lowering platform decides, not the default device: export for TPU works here."""
  q, k, v, beta, la, ip = _abstract_args(16, 32, jnp.bfloat16, 40)[:6]

  def loss(q, k, v, beta, la, ip):
    result = palimpsa(q, k, v, beta, la, ip, implementation="pallas_tpu")
    return jnp.sum(result.out.astype(jnp.float32)) + jnp.sum(result.state.mu)

  exported = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))),
                               platforms=["tpu"])(q, k, v, beta, la, ip)
  assert exported.platforms == ("tpu",)
  assert exported.mlir_module().count("tpu_custom_call") == 3
  if jax.default_backend() != "tpu":
    with pytest.raises(NotImplementedError, match="lower only for TPU"):
      jax.jit(loss).lower(q, k, v, beta, la, ip)


@pytest.mark.parametrize("short_chunks", [False, True])
def test_blocks_are_tpu_legal(short_chunks):
  for kd in HEAD_DIMS:
    for t in (1, 37, 128, 300, 4096):
      g = geometry((2, t, 3, kd), 192, chunk_size=64, short_chunks=short_chunks)
      assert g.kp % 16 == 0 and g.vp % 128 == 0 and g.chunk % 16 == 0
      if short_chunks:
        assert g.chunk % 128 == 0 or g.chunk == g.tp
      else:
        assert g.chunk % 128 == 0
      assert g.tp % g.chunk == 0 and g.chunk % g.sub == 0 and g.sub % 8 == 0


def test_unsupported_key_dim_raises_not_implemented():
  args = [jnp.zeros(a.shape, a.dtype) for a in _abstract_args(264, 8, jnp.float32, 4)]
  with pytest.raises(NotImplementedError, match="key dims"):
    palimpsa_tpu(*args, return_variance=False, chunk_size=64, interpret=True)


def test_declines_compiled_call_without_tpu():
  if jax.default_backend() == "tpu":
    pytest.skip("a TPU is present")
  args = [jnp.zeros(a.shape, a.dtype) for a in _abstract_args(16, 16, jnp.float32, 4)]
  with pytest.raises(NotImplementedError, match="needs a TPU"):
    palimpsa_tpu(*args, return_variance=False, chunk_size=64, interpret=False)


def test_op_dispatches_to_the_kernel():
  args = [jnp.zeros(a.shape, a.dtype) for a in _abstract_args(16, 16, jnp.float32, 8)]
  q, k, v, beta, la, ip, mu0, prec0, seg = args
  jaxpr = jax.make_jaxpr(lambda *a: palimpsa(
      *a, initial_state=PalimpsaState(mu0, prec0 + 1.0), segment_ids=seg.astype(jnp.int32),
      implementation="pallas_tpu", interpret=True).out)(q, k, v, beta, la, ip + 1.0)
  assert "pallas_call" in str(jaxpr)

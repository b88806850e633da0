"""The fused chunk-read kernels (pallas_kernels/fast_palimpsa_gpu/reads*.py) against the same
function in float32 jnp, values and every gradient: interpreted on CPU, compiled on a Hopper
GPU (-m gpu), and lowered for sm_90 on the CPU at the benchmarks' heads."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import round_up
from pallas_kernels.fast_palimpsa_gpu import reads, reads_backward, reads_forward
from pallas_kernels.fast_palimpsa_gpu.tiles import BackwardTiles, ForwardTiles
from pallas_kernels.palimpsa_gpu.mosaic_tiles import SMEM_LIMIT
from tests.ops.numerics import BFLOAT16_TOL, assert_close_to_reference

f32, bf16 = jnp.float32, jnp.bfloat16
NAMES = ("q", "k", "v", "beta", "rows", "bk", "bv", "m_c", "b_c", "ip")


def reference_reads(q, k, v, beta, rows, bk, bv, m_c, b_c, ip_bh, *, chunk, k_true,
                    with_var):
  """The kernels' function of their inputs (reads_forward.py's docstring) in float32 jnp."""
  b, tp, h, kp = q.shape
  vp, nc = v.shape[-1], tp // chunk
  ipb = ip_bh[:, None, None, None]
  n_c = m_c / (b_c + ipb) * (bv[..., :, None] + ipb) * (bk[..., None, :] + ipb)
  per_step = jnp.moveaxis(rows, 2, 1).reshape(b, h, rows.shape[2], nc, chunk)
  g, ids, f, cs, ip, mb = (per_step[:, :, i, ..., None] for i in range(6))  # [B,H,NC,C,1]
  chunks = lambda x: jnp.moveaxis(x.astype(f32), 2, 1).reshape(b, h, nc, chunk, x.shape[-1])
  q, k, v, beta = map(chunks, (q, k, v, beta))
  bk, bv = bk.reshape(b, h, nc, 1, kp), bv.reshape(b, h, nc, 1, vp)
  n_c = n_c.reshape(b, h, nc, vp, kp)
  t = jnp.arange(chunk)
  mask = (t[None, :] <= t[:, None]) & (ids == jnp.swapaxes(ids, -1, -2))
  decay = jnp.where(mask, jnp.exp(jnp.where(mask, g - jnp.swapaxes(g, -1, -2), 0.0)), 0.0)
  mm = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
  ksq = k * k
  mk = jnp.sum(ksq, -1, keepdims=True) / k_true
  ibk = f * bk + mm("...ts,...sk->...tk", decay, mb * ksq) + ip
  qk = q / ibk
  ibs = (jnp.sum(ibk, -1, keepdims=True) - (kp - k_true) * ip) / k_true
  w = mm("...tk,...sk->...ts", qk, k) * decay
  z = mm("...ts,...sv->...tv", w, v) + cs * mm("...tk,...vk->...tv", qk, n_c)
  ibv = f * bv + mm("...ts,...sv->...tv", decay, beta * mk) + ip
  scale = ibs / ibv
  steps = lambda y: jnp.moveaxis(y.reshape(b, h, tp, vp), 1, 2)
  return steps(z * scale), steps(jnp.sum(q * qk, -1, keepdims=True) * scale) if with_var else None


def _inputs(seed, b, t, h, kd, vd, rows_per_cta, chunk):
  """fused_reads' arrays (padded as the op pads them) and cotangents zero on the padding."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 12)
  tp, kp, vp = round_up(t, rows_per_cta), round_up(kd, 16), round_up(vd, 16)
  n = tp // chunk
  pad = lambda x, w: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, w - x.shape[-1])))
  normal = lambda i, shape, scale=1.0: jax.random.normal(keys[i], shape) * scale
  q = pad(normal(0, (b, t, h, kd), kd ** -0.5).astype(bf16), kp)
  k = pad(normal(1, (b, t, h, kd), kd ** -0.5).astype(bf16), kp)
  v = pad(normal(2, (b, t, h, vd)).astype(bf16), vp)
  beta = pad(jax.random.uniform(keys[3], (b, t, h, vd)).astype(bf16), vp)
  log_alpha = jnp.log(jax.random.uniform(keys[4], (b, tp, h), minval=0.6, maxval=1.0))
  starts = jax.random.uniform(keys[5], (b, tp)) < 0.05
  ip = jax.random.uniform(keys[6], (h,), minval=0.5, maxval=2.0)
  g, ids, from_start, _ = reads.step_gates(log_alpha, starts, chunk)
  mean_beta = jnp.sum(beta.astype(f32), -1) / vd
  ps = jax.random.uniform(keys[7], (b * h, n), minval=1.0, maxval=3.0)
  rows = reads.step_rows(g, ids, from_start, ps, ip, mean_beta, rows_per_cta, chunk)
  margin = lambda i, d, dp: jnp.pad(jax.random.uniform(keys[i], (b * h, n, d)) * 2,
                                    ((0, 0), (0, 0), (0, dp - d)))
  state = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, vp - vd), (0, kp - kd)))
  m_c = state(normal(10, (b * h, n, vd, kd)))
  b_c = state(jax.random.uniform(keys[0], (b * h, n, vd, kd)) * 3)
  args = (q, k, v, beta, rows, margin(8, kd, kp), margin(9, vd, vp), m_c, b_c, jnp.tile(ip, b))
  live = (jnp.arange(tp) < t)[None, :, None, None] & (jnp.arange(vp) < vd)
  cotangents = tuple(jnp.where(live, normal(11 - i, (b, tp, h, vp)), 0.0) for i in range(2))
  return args, cotangents


def check_fused_reads(seed, shape, forward, backward, with_var, interpret):
  b, t, h, kd, vd = shape
  chunk = forward.chunk
  args, (ct_out, ct_var) = _inputs(seed, b, t, h, kd, vd, forward.rows, chunk)
  call = reads.ReadsCall(h, chunk, kd, with_var, forward, backward, interpret)

  def loss(fn, *a):
    out, var = fn(*a)
    total = jnp.sum(out.astype(f32) * ct_out)
    return total + jnp.sum(var * ct_var) if with_var else total

  kernel = lambda *a: reads.fused_reads(*a, call)
  ref = functools.partial(reference_reads, chunk=chunk, k_true=kd, with_var=with_var)
  grads = lambda fn, a: jax.jit(jax.value_and_grad(functools.partial(loss, fn),
                                                   argnums=tuple(range(10))))(*a)
  got_out = jax.jit(kernel)(*args)
  want_out = ref(*[x.astype(f32) for x in args])
  _, got = grads(kernel, args)
  _, want = grads(ref, [x.astype(f32) for x in args])
  label = f"{shape} {forward} {backward} var={with_var} "
  outs = dict(out=got_out[0]) | (dict(variance=got_out[1]) if with_var else {})
  want_outs = dict(out=want_out[0]) | (dict(variance=want_out[1]) if with_var else {})
  assert_close_to_reference(outs, want_outs, BFLOAT16_TOL, label)
  # bk's padded columns: the kernel leaves their cotangent 0, the op drops it (the
  # reference's mean over the true K still depends on them).
  true_k = lambda grads: (*grads[:5], grads[5][..., :kd], *grads[6:])
  assert_close_to_reference(dict(zip(NAMES, true_k(got))), dict(zip(NAMES, true_k(want))),
                            BFLOAT16_TOL, label)


# (B, T, H, K, V), ForwardTiles, BackwardTiles, variance. The first: one 64-step chunk a
# CTA, K and V padded (20 -> 32, 40 -> 48), T padded, three forward V-blocks, three
# backward V sub-tiles through a ring of 2, two K-blocks (the second past the true K), with
# the variance. Then (slow): two chunks of 32 a CTA (block-diagonal D, per-chunk N) with
# three V sub-tiles in one forward CTA, a ring of 1 and three backward K-blocks of 16; four
# chunks of 16; one chunk of 128 (two wgmma row groups).
_CASES = [
    ((1, 100, 2, 20, 40), ForwardTiles(64, 16), BackwardTiles(64, 16, 2, 16), True),
    ((2, 70, 1, 48, 48), ForwardTiles(32, 16, 3), BackwardTiles(32, 64, 1, 16), False),
    ((1, 64, 1, 16, 32), ForwardTiles(16, 32), BackwardTiles(16, 64, 2, 16), True),
    ((1, 256, 1, 16, 32), ForwardTiles(128, 32), BackwardTiles(128, 32, 1, 16), False),
]
# The compiled cases add Palimpsa-D 760M's and K128 heads: V in three sub-tiles, K in
# three blocks (a block of 32 past K at K = 80) and in one.
_COMPILED_CASES = _CASES + [
    ((2, 512, 3, 96, 192), ForwardTiles(64, 64, 3), BackwardTiles(64, 64, 1, 32), True),
    ((2, 512, 3, 80, 192), ForwardTiles(64, 64), BackwardTiles(64, 64, 2, 32), False),
    ((2, 512, 2, 128, 128), ForwardTiles(64, 128), BackwardTiles(64, 64, 2, 64), False),
]


@pytest.mark.parametrize("shape, forward, backward, with_var", [
    _CASES[0], *(pytest.param(*case, marks=pytest.mark.slow) for case in _CASES[1:])])
def test_interpreted_matches_the_jnp_reads(shape, forward, backward, with_var):
  """With the interpreter's race detector (TMA copies against the CTA's accesses)."""
  check_fused_reads(0, shape, forward, backward, with_var,
                    plgpu.InterpretGPUParams(detect_races=True))
  assert not interpret_pallas_call.get_races().races_found


@pytest.mark.gpu
@pytest.mark.parametrize("shape, forward, backward, with_var", _COMPILED_CASES)
def test_compiled_matches_the_jnp_reads(shape, forward, backward, with_var):
  check_fused_reads(1, shape, forward, backward, with_var, False)


@pytest.mark.parametrize("shape, forward, backward, with_var", _COMPILED_CASES)
def test_compiled_cases_lower_for_sm_90(shape, forward, backward, with_var):
  """The GPU cases' kernels, forward and backward, lower for sm_90 on a CPU host: Mosaic
  GPU checks there what the GPU run would refuse (shared memory over the limit, a TMA copy
  of a width it cannot tile or of a byte count that is no multiple of 128)."""
  b, t, h, kd, vd = shape
  args, _ = jax.eval_shape(lambda: _inputs(0, b, t, h, kd, vd, forward.rows, forward.chunk))
  call = reads.ReadsCall(h, forward.chunk, kd, with_var, forward, backward, False)

  def loss(*a):
    out, var = reads.fused_reads(*a, call)
    return jnp.sum(out.astype(f32)) + (jnp.sum(var) if with_var else 0.0)

  grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(10))))
  text = grad.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 3


@pytest.mark.parametrize("shape, forward, backward, with_var", _COMPILED_CASES)
def test_compiled_cases_fit_shared_memory(shape, forward, backward, with_var):
  """Mosaic GPU refuses a CTA over the limit when it lowers: the GPU cases' tiles fit."""
  kp, vp = round_up(shape[3], 16), round_up(shape[4], 16)
  assert reads_forward.smem_bytes(forward, kp, vp, bf16, with_var) <= SMEM_LIMIT
  assert reads_backward.smem_bytes(backward, kp, vp, with_var) <= SMEM_LIMIT


def test_declines_what_it_cannot_run():
  x = lambda d, dtype=bf16: jnp.zeros((1, 8, 1, d), dtype)
  call = functools.partial(reads.reads_call, chunk=64, with_var=False, interpret=False)
  with pytest.raises(NotImplementedError, match="bfloat16"):
    call(x(16, f32), x(16, f32), x(32, f32), x(32, f32))
  with pytest.raises(NotImplementedError, match="chunks of 16, 32, 64 or 128"):
    reads.reads_call(x(16), x(16), x(32), x(32), chunk=8, with_var=False, interpret=False)
  with pytest.raises(NotImplementedError, match="shared memory"):
    reads.reads_call(x(96), x(96), x(192), x(192), chunk=128, with_var=True, interpret=False)
  assert call(x(96), x(96), x(192), x(192)).chunk == 64


@pytest.mark.parametrize("chunk, kp, vp", sorted(reads.TUNED))
@pytest.mark.parametrize("with_var", [False, True])
def test_default_tiles_fit_with_and_without_the_variance(chunk, kp, vp, with_var):
  """The tuned tiles (measured without the variance) are kept only where they fit, each
  direction on its own; the provisional tiles fit."""
  forward, backward = reads.default_tiles(chunk, kp, vp, with_var)
  assert reads.fits((forward, backward), kp, vp, with_var)
  tuned = reads.TUNED[chunk, kp, vp]
  tuned_forward = ForwardTiles(chunk, *tuned[:2])
  if reads_forward.smem_bytes(tuned_forward, kp, vp, bf16, with_var) <= SMEM_LIMIT:
    assert forward == tuned_forward
  if tuned[2:]:
    tuned_backward = BackwardTiles(chunk, *tuned[2:], reads.default_k_sub(kp))
    if reads_backward.smem_bytes(tuned_backward, kp, vp, with_var) <= SMEM_LIMIT:
      assert backward == tuned_backward
  if not with_var:  # The records' tiles fit without the variance.
    assert forward == tuned_forward
    assert not tuned[2:] or backward == tuned_backward


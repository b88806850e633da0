"""The op suite for implementation="pallas_gpu": interpreted on CPU, compiled on a GPU."""

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
# jax.ad_checkpoint.print_saved_residuals only prints; this is the list it prints.
from jax._src.ad_checkpoint import saved_residuals
import numpy as np
import pytest

from pallas_kernels.palimpsa_gpu import (backward, carries_triton, forward, stages,
                                         walk_backward_mosaic, walk_backward_triton,
                                         walk_forward_mosaic, walk_forward_triton)
from pallas_kernels.palimpsa_gpu import config as gpu_config
from pallas_kernels.palimpsa_gpu import make_config, palimpsa_gpu
from pallas_kernels.palimpsa_gpu import op as op_module
from tests.ops.palimpsa.palimpsa_suite import PalimpsaSuite


class TestPallasGpuInterpret(PalimpsaSuite):
  IMPLEMENTATION = "pallas_gpu"
  INTERPRET = True
  # Three 16-step chunks (T=37, the last one padded) with segments: restarts at t=10
  # (inside the first chunk) and t=16 (on a chunk boundary); then K=48 walked as three
  # 16-column K-parts.
  SHAPES = (((2, 37, 2, 8, 20), 16, ((10, 6, 21), (37,))),
            ((1, 40, 1, 48, 24), 16, None))
  LONG_RUN = False


@pytest.mark.gpu
class TestPallasGpuCompiled(PalimpsaSuite):
  IMPLEMENTATION = "pallas_gpu"
  INTERPRET = False
  SHAPES = PalimpsaSuite.SHAPES + (
      ((2, 300, 3, 48, 96), 64, ((100, 150, 50), (300,))),
      ((1, 200, 2, 96, 192), 64, None),
  )


def test_declines_too_large_heads():
  x = jnp.zeros((1, 4, 1, 512))
  v = jnp.zeros((1, 4, 1, 16))
  with pytest.raises(NotImplementedError, match="K, V <= 256"):
    palimpsa_gpu(x, x, v, v, jnp.zeros((1, 4, 1)), jnp.ones((1,)),
                 jnp.zeros((1, 1, 16, 512)), jnp.ones((1, 1, 16, 512)), None,
                 return_variance=False, chunk_size=64, interpret=True)


def test_declines_compiled_call_without_nvidia_gpu():
  if jax.devices()[0].platform == "gpu":
    pytest.skip("a GPU is present")
  x = jnp.zeros((1, 4, 1, 16))
  with pytest.raises(NotImplementedError, match="NVIDIA GPU"):
    palimpsa_gpu(x, x, x, x, jnp.zeros((1, 4, 1)), jnp.ones((1,)),
                 jnp.zeros((1, 1, 16, 16)), jnp.ones((1, 1, 16, 16)), None,
                 return_variance=False, chunk_size=64, interpret=False)


def _run(cfg, *args):
  """palimpsa_gpu with the config cfg on args (..., initial_precision), no segments."""
  return palimpsa_gpu(*args, None, return_variance=cfg.return_variance, chunk_size=cfg.chunk,
                      interpret=cfg.interpret, config=cfg)


def _random_op_args(seed: int, shape: tuple[int, int, int, int, int]) -> tuple:
  """(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision) for
  shape (B, T, H, K, V): random inputs and a random initial state."""
  b, t, h, kd, vd = shape
  keys = jax.random.split(jax.random.PRNGKey(seed), 7)
  return (jax.random.normal(keys[0], (b, t, h, kd)) / 4,
          jax.random.normal(keys[1], (b, t, h, kd)) / 4,
          jax.random.normal(keys[2], (b, t, h, vd)),
          jax.random.uniform(keys[3], (b, t, h, vd)),
          -jax.random.uniform(keys[4], (b, t, h)) * 0.3,
          jnp.ones((h,)) * 0.7,
          jax.random.normal(keys[5], (b, h, vd, kd)),
          1.0 + jax.random.uniform(keys[6], (b, h, vd, kd)))


@pytest.mark.parametrize("k_dim", [16, pytest.param(48, marks=pytest.mark.slow)])
def test_tile_variants_agree(k_dim):
  """Other tilings (V-tile groups, sub-chunks, unrolling, prefetch, K-parts) and both
  kinds of walks agree with the default (interpreted: the Mosaic GPU walks).

  `triton` is the default with the Triton walks: at K=16 8-column parts over
  V-tiles of up to 32 rows, at K=48 three 16-column K-slices, one program each. The
  variants below use it.
  `variant` walks all three stages in 16-column parts inside one program. `sliced` walks the
  backward's K in slices of 8 columns, each as two 4-column parts. `padded` (K=48)
  pads the backward's K to 64, read past the boundary states' 48 columns as zeros.
  """
  args = _random_op_args(0, (1, 40, 1, k_dim, 48))
  base = make_config(args[0], args[2], args[4], args[5], return_variance=True,
                     chunk_size=16, interpret=True)
  assert base.backends == ("mosaic",) * 4
  assert not base.accumulate_bwd
  triton = make_config(args[0], args[2], args[4], args[5], return_variance=True,
                       chunk_size=16, interpret=True, backend="triton")
  fwd, bwd = triton.walk_fwd, triton.walk_bwd
  variant = dataclasses.replace(
      triton, walk_fwd=dataclasses.replace(fwd, block_v=16, unroll=1, k_part=8),
      walk_bwd=dataclasses.replace(bwd, block_v=16, sub=8, groups=3, k_part=16, k_split=1))
  assert (variant.k_boundary, variant.k_bwd) == (k_dim, k_dim)
  sliced = dataclasses.replace(triton, walk_bwd=dataclasses.replace(
      bwd, k_part=4, k_split=k_dim // 8, groups=3, block_v=16))
  assert sliced.k_bwd == k_dim
  variants = [triton, variant, sliced]
  if k_dim == 48:
    assert (fwd.k_part, base.k_boundary, base.k_bwd) == (16, 48, 48)
    assert (bwd.k_part, bwd.k_split, bwd.block_v, bwd.groups, bwd.prefetch) == (
        16, 3, 16, 3, True)
    padded = dataclasses.replace(triton, walk_bwd=dataclasses.replace(
        bwd, k_part=64, k_split=1, groups=1, sub=2, prefetch=False))
    assert padded.k_bwd == 64
    variants.append(padded)

  def grads(cfg):
    def loss(*a):
      out, var, mu, prec = _run(cfg, *a)
      return jnp.sum(out * out) + jnp.sum(var) + jnp.sum(mu) + jnp.sum(prec)
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(8))))(*args)

  v0, g0 = grads(base)
  for cfg in variants:
    v1, g1 = grads(cfg)
    chex.assert_trees_all_close(v1, v0, rtol=1e-6)
    for a, b_ in zip(g1, g0):
      chex.assert_trees_all_close(a, b_, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b_))))


def test_backward_walk_in_pieces_agrees():
  """The backward walk cut by batch*head (a temp-memory cap) gives the same gradients."""
  b, h = 2, 2
  args = _random_op_args(4, (b, 40, h, 32, 16))
  base = make_config(args[0], args[2], args[4], args[5], return_variance=False,
                     chunk_size=16, interpret=True)
  pieces = dataclasses.replace(base, max_walk_temp_bytes=1)
  assert (stages.walk_pieces(base), stages.walk_pieces(pieces)) == (1, b * h)

  def grads(cfg):
    loss = lambda *a: jnp.sum(_run(cfg, *a)[0] ** 2)
    return jax.jit(jax.grad(loss, argnums=tuple(range(8))))(*args)

  for a, b_ in zip(grads(pieces), grads(base)):  # Sums over heads may reorder.
    chex.assert_trees_all_close(a, b_, rtol=1e-6, atol=1e-7 * float(jnp.max(jnp.abs(b_))))


@pytest.mark.parametrize("with_var", [False, True])
def test_the_vjp_keeps_only_its_arguments(with_var):
  """The op's residuals are its own arguments (and the variance it returns): no head-major
  copy [BH, Tp, D], no gates, no boundary or final states; the backward recomputes them.
  Per token that is at most the bytes of the arguments (q, k, v, beta, log_alpha, and the
  prior and initial state spread over T) and of the variance."""
  b, t, h, kd, vd = 1, 64, 2, 8, 20  # K and V padded to 16 and 32 inside the kernel.
  args = _random_op_args(0, (b, t, h, kd, vd))
  args = tuple(x.astype(jnp.bfloat16) if x.ndim == 4 and x.shape[1] == t else x
               for x in args)

  def outputs(*a):
    out, var, _, _ = palimpsa_gpu(*a, None, return_variance=with_var, chunk_size=16,
                                  interpret=True)
    return (out, var) if with_var else out

  saved = saved_residuals(outputs, *args)
  computed = [(aval, source) for aval, source in saved
              if not source.startswith("from the argument")]
  if with_var:  # The variance, as the walk returned it.
    assert [aval.shape for aval, _ in computed] == [(b, t, h, vd)], computed
  else:
    assert not computed, computed
  nbytes = lambda x: x.size * x.dtype.itemsize
  per_token = sum(nbytes(aval) for aval, _ in saved) / (b * t)
  arguments = sum(nbytes(x) for x in args) / (b * t)
  assert per_token <= arguments + (4 * h * vd if with_var else 0)


def test_bf16_chunk_writes_match_float32_products():
  """bfloat16 v, beta: chunk writes as exact bf16 products of a 3-term split of w * k^p.

  The final state (float32, from the boundary kernel) must agree to float32 accuracy with
  the same values given as float32, whose chunk writes are float32 products.
  """
  b, t, h, kd, vd = 1, 256, 2, 48, 32
  keys = jax.random.split(jax.random.PRNGKey(3), 5)
  bf16 = jnp.bfloat16
  q = (jax.random.normal(keys[0], (b, t, h, kd)) / 4).astype(bf16)
  k = (jax.random.normal(keys[1], (b, t, h, kd)) / 4).astype(bf16)
  v = jax.random.normal(keys[2], (b, t, h, vd)).astype(bf16)
  beta = jax.random.uniform(keys[3], (b, t, h, vd)).astype(bf16)
  log_alpha = -jax.random.uniform(keys[4], (b, t, h)) * 0.1
  ip = jnp.ones((h,))
  state = (jnp.zeros((b, h, vd, kd)), jnp.ones((b, h, vd, kd)))

  def final_state(v, beta):
    return palimpsa_gpu(q, k, v, beta, log_alpha, ip, *state, None, return_variance=False,
                        chunk_size=64, interpret=True)[2:]

  split = final_state(v, beta)
  full = final_state(v.astype(jnp.float32), beta.astype(jnp.float32))
  for a, b_ in zip(split, full):
    chex.assert_trees_all_close(a, b_, rtol=2e-6, atol=2e-6 * float(jnp.max(jnp.abs(b_))))


def test_a_config_made_for_another_call_is_refused():
  args = _random_op_args(0, (1, 40, 1, 16, 16))
  cfg = make_config(args[0], args[2], args[4], args[5], return_variance=False, chunk_size=16,
                    interpret=True)
  with pytest.raises(ValueError, match="config.return_variance is False"):
    palimpsa_gpu(*args, None, return_variance=True, chunk_size=16, interpret=True, config=cfg)
  with pytest.raises(ValueError, match="config.chunk is 16, but this call has 32"):
    palimpsa_gpu(*args, None, return_variance=False, chunk_size=32, interpret=True, config=cfg)


@pytest.mark.parametrize("num_chunks, k_width", [(8, 48), (6, 16), (3, 32)])
def test_adjoint_carries_match_a_reverse_loop(num_chunks, k_width):
  """The carries kernel (unrolled by 4, 2 or 1 chunks; K in parts) against a plain loop."""
  bh, vp = 2, 32
  keys = jax.random.split(jax.random.PRNGKey(num_chunks), 5)
  end_m, end_b = (jax.random.normal(key, (bh, vp, k_width)) for key in keys[:2])
  gate = jax.random.uniform(keys[2], (bh, num_chunks))
  local_m, local_b = (jax.random.normal(key, (bh, num_chunks, vp, k_width))
                      for key in keys[3:])
  carry_m, carry_b, m0, b0 = carries_triton.adjoint_carries(
      end_m, end_b, gate, local_m, local_b, block_v=16, interpret=True)
  cm, cb = end_m, end_b
  for c in reversed(range(num_chunks)):
    chex.assert_trees_all_close(carry_m[:, c], cm, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(carry_b[:, c], cb, rtol=1e-6, atol=1e-6)
    g = gate[:, c, None, None]
    cm, cb = local_m[:, c] + g * cm, local_b[:, c] + g * cb
  chex.assert_trees_all_close(m0, cm, rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_close(b0, cb, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("restart_rate", [0.0, 0.05, 0.4])
def test_segmented_reverse_cumsum_matches_a_loop(restart_rate):
  """dlog_alpha's segment-wise reverse sums against a loop."""
  rng = np.random.default_rng(7)
  bh, chunk, nc = 3, 8, 7
  x = rng.normal(size=(bh, chunk * nc)).astype(np.float32)
  reset = rng.random(x.shape) < restart_rate
  reset[0, chunk] = True  # a restart on a chunk boundary
  got = np.asarray(backward.segmented_reverse_cumsum(jnp.asarray(x), jnp.asarray(reset)))
  want = np.zeros_like(x)
  for n in range(bh):
    total = 0.0
    for t in reversed(range(x.shape[1])):
      total += x[n, t]
      want[n, t] = total
      if reset[n, t]:
        total = 0.0
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


def test_forward_walk_rejects_an_unroll_longer_than_the_chunk():
  x = jnp.zeros((1, 16, 1, 16))
  with pytest.raises(ValueError, match="unroll=32 steps per body"):
    walk_forward_triton.walk_forward(x, x, x, x, jnp.ones((1, 16)), jnp.ones((1, 16)),
                                     jnp.zeros((1, 1, 16, 16)), jnp.zeros((1, 1, 16, 16)),
                                     heads=1, chunk=16, block_v=16, unroll=32, k_part=16,
                                     with_var=False, out_dtype=jnp.float32, num_warps=1,
                                     interpret=True)


_WALK_ARGS = ("q", "k", "v", "beta", "a", "ip_row", "do", "dvar", "m_starts", "b_starts")


def _walk_inputs(seed, b, h, t, k_dim, v_dim, chunk, dtype):
  """Backward-walk inputs by name (`_WALK_ARGS` is the walks' argument order): rows
  [B, T, H, D] in dtype (the caller's layout), gates in (0.6, 1), positive precisions,
  random chunk-start states [B*H, T/chunk, V, K]."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 10)
  nc, bh = t // chunk, b * h
  rows = lambda key, d, scale=1.0: (jax.random.normal(key, (b, t, h, d)) * scale).astype(dtype)
  return dict(
      q=rows(keys[0], k_dim), k=rows(keys[1], k_dim, k_dim ** -0.5), v=rows(keys[2], v_dim),
      beta=jax.random.uniform(keys[3], (b, t, h, v_dim), minval=0.1).astype(dtype),
      a=jax.random.uniform(keys[4], (bh, t), minval=0.6),
      ip_row=jax.random.uniform(keys[5], (bh, k_dim), minval=0.5, maxval=2.0),
      do=rows(keys[6], v_dim), dvar=jax.random.normal(keys[7], (b, t, h, v_dim)),
      m_starts=jax.random.normal(keys[8], (bh, nc, v_dim, k_dim)),
      b_starts=jax.random.uniform(keys[9], (bh, nc, v_dim, k_dim), maxval=3.0))


# (with_var, T, bh_range, every, K)
_VAR_192 = (True, 192, None, None, 32)  # with the variance; 3 chunks, not a multiple of 4
_PIECES_256 = (False, 256, (1, 2), 4, 32)  # batch-heads 1, 2 (across batches); checkpoints 4
_TWO_128 = (False, 128, None, None, 32)  # 2 chunks; float32 rows: ring slots of 8 steps
_K16_128 = (False, 128, None, None, 16)  # one K-slice: dv, dbeta stored, not added


@pytest.mark.parametrize("interpret, accumulate, with_var, t, bh_range, every, k_dim, dtype", [
    pytest.param(True, False, *_VAR_192, jnp.float32, marks=pytest.mark.slow),
    (True, False, *_PIECES_256, jnp.float32), (True, False, *_TWO_128, jnp.float32)] + [
        pytest.param(False, accumulate, *case, dtype, marks=pytest.mark.gpu)
        for accumulate in (False, True)
        for case, dtype in ((_VAR_192, jnp.bfloat16), (_PIECES_256, jnp.bfloat16),
                            (_TWO_128, jnp.float32), (_K16_128, jnp.bfloat16))])
def test_mosaic_backward_walk_matches_triton_walk(interpret, accumulate, with_var, t,
                                                  bh_range, every, k_dim, dtype):
  """walk_backward_mosaic.walk_backward gives walk_backward_triton.walk_backward's partial sums
  (or, with `accumulate`, their totals) and adjoints: with and without the variance's
  cotangent, a chunk count that is not a multiple of 4 (T=192: 3 chunks), a batch*head range
  (rows of two batches and heads, read in the caller's layout),
  checkpoints every 8 (default) or 4 steps, ring slots of a quarter chunk (16-bit rows, or
  checkpoints every 4) or of 8 steps (float32 rows), and one K-slice (K=16: with
  `accumulate`, dv and dbeta are stored by one tile each instead of added)."""
  chunk, v_dim = 64, 48
  rows = [dtype] * 5 + ([jnp.float32] if with_var else [])
  every_or_default = every or walk_backward_mosaic.checkpoint_every(chunk)
  quarter = walk_backward_mosaic.slot_steps(chunk, 4, rows, every_or_default) == chunk // 4
  assert quarter == (dtype == jnp.bfloat16 or every == 4)
  x = _walk_inputs(0, 2, 2, t, k_dim, v_dim, chunk, dtype)
  if not with_var:
    x["dvar"] = None
  args = [x[n] for n in _WALK_ARGS]
  triton = walk_backward_triton.walk_backward(
      *args, heads=2, chunk=chunk, block_v=16, sub=4, groups=v_dim // 16, k_part=16,
      k_split=k_dim // 16, num_warps=1, interpret=interpret, prefetch=True, bh_range=bh_range)
  if accumulate:  # One part: the sum of the partial sums.
    triton = [jnp.sum(part, axis=0, keepdims=True) for part in triton[:4]] + [
        jnp.sum(triton[4], axis=(0, 1), keepdims=True)] + list(triton[5:])
  mosaic = walk_backward_mosaic.walk_backward(*args, heads=2, chunk=chunk, sub=4,
                                              interpret=interpret, bh_range=bh_range,
                                              accumulate=accumulate, every=every)
  names = ("dq", "dk", "dv", "dbeta", "s", "adj_m", "adj_b")
  for name, got, want in zip(names, mosaic, triton):
    chex.assert_equal_shape([got, want], custom_message=name)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))),
                                custom_message=name)


def test_mosaic_backward_walk_rejects_accumulate_in_interpret_mode():
  x = _walk_inputs(0, 1, 1, 64, 16, 16, 64, jnp.float32)
  args = [x[n] for n in _WALK_ARGS]
  with pytest.raises(ValueError, match="accumulate"):
    walk_backward_mosaic.walk_backward(*args, heads=1, chunk=64, sub=4, interpret=True,
                                       accumulate=True)


@pytest.mark.parametrize("flags, deterministic", [
    ("", False), ("--xla_gpu_deterministic_ops", True),
    ("--xla_gpu_autotune_level=0 --xla_gpu_deterministic_ops=true", True),
    ("--xla_gpu_deterministic_ops=false", False)])
def test_reduce_add_only_without_deterministic_ops(monkeypatch, flags, deterministic):
  """Compiled calls add the walk's sums by TMA reduce-add unless XLA_FLAGS asks for
  deterministic ops; interpreted calls never do (interpret mode has no reduce-add)."""
  monkeypatch.setenv("XLA_FLAGS", flags)
  assert gpu_config.deterministic_ops_requested() == deterministic
  args = _random_op_args(0, (1, 64, 1, 16, 16))
  for interpret in (True, False):
    cfg = make_config(args[0], args[2], args[4], args[5], return_variance=False,
                      chunk_size=64, interpret=interpret)
    assert cfg.accumulate_bwd == (not interpret and not deterministic)


def test_kernel_choice(monkeypatch):
  """Mosaic where it runs: interpreted on one device, or compiled on Hopper+ with sizes and
  rows that fit it (backward: 16-bit rows up to chunk 128, float32 rows up to chunk 64;
  forward: K up to 128)."""
  bf16, f32 = jnp.bfloat16, jnp.float32
  assert walk_backward_mosaic.supported(64, 4, [bf16] * 5, interpret=False)
  assert walk_backward_mosaic.supported(64, 4, [bf16] * 5 + [f32], interpret=False)
  assert walk_backward_mosaic.supported(64, 4, [f32] * 6, interpret=False)
  assert walk_backward_mosaic.supported(128, 4, [bf16] * 6, interpret=False)
  assert not walk_backward_mosaic.supported(128, 4, [f32] * 5, interpret=False)
  assert walk_backward_mosaic.supported(16, 4, [f32] * 5, interpret=True)  # Checkpoints every 4.
  assert not walk_backward_mosaic.supported(16, 8, [f32] * 5, interpret=True)  # 4-step quarters.
  limit = walk_backward_mosaic.SMEM_LIMIT
  for rows in ([bf16] * 5, [bf16] * 5 + [f32], [f32] * 5, [f32] * 6):  # Two CTAs per SM.
    assert walk_backward_mosaic.smem_bytes(64, 4, rows) <= walk_backward_mosaic.TWO_PER_SM
  for kp in (16, 96, 128):
    for dtype in (bf16, f32):
      assert walk_forward_mosaic.supported(128, kp, [dtype] * 4, dtype, True, interpret=False)
  assert walk_forward_mosaic.smem_bytes(96, [bf16] * 4, bf16, False) <= (
      limit // 2)  # Two CTAs per SM at D760's heads.
  assert not walk_forward_mosaic.supported(64, 144, [bf16] * 4, bf16, False, interpret=True)
  capability = gpu_config.compute_capability()

  def runs(supported, interpret, hopper_only=False, devices=1):  # No reason to refuse.
    call = gpu_config.StageCall(64, 16, 16, f32, f32, f32, f32, False, interpret, capability,
                                devices)
    return gpu_config.mosaic_refusal(supported, call, hopper_only) is None

  assert runs(True, interpret=True)
  assert not runs(False, interpret=True)
  assert runs(True, interpret=False) == (capability >= (9, 0))
  assert not runs(False, interpret=False)
  assert runs(True, interpret=False, hopper_only=True) == (capability[0] == 9)
  assert runs(True, interpret=True, hopper_only=True)
  assert not runs(True, interpret=True, devices=4)
  args = _random_op_args(0, (1, 64, 1, 144, 16))
  cfg = make_config(*args[:1], args[2], args[4], args[5], return_variance=False,
                    chunk_size=64, interpret=True)
  assert cfg.backends[1:3] == ("triton", "mosaic")
  monkeypatch.setattr(jax, "local_device_count", lambda: 4)
  cfg = make_config(*args[:1], args[2], args[4], args[5], return_variance=False,
                    chunk_size=64, interpret=True)
  assert cfg.backends == ("triton",) * 4


@pytest.mark.parametrize("interpret, chunk, k_dim, v_dim, k_state, with_var", [
    (True, 16, 32, 16, 48, True),  # Saved states wider than K; 4 chunks of 16.
    (True, 16, 16, 32, 16, False),  # 3 chunks: a group of 4 padded.
    pytest.param(False, 64, 96, 192, 96, False, marks=pytest.mark.gpu),
    pytest.param(False, 128, 48, 96, 48, True, marks=pytest.mark.gpu)])
def test_mosaic_forward_walk_matches_triton_walk(interpret, chunk, k_dim, v_dim, k_state,
                                                 with_var):
  """walk_forward_mosaic.walk_forward gives walk_forward_triton.walk_forward's readouts and
  variances (float32 rows interpreted, bfloat16 rows compiled)."""
  dtype = jnp.float32 if interpret else jnp.bfloat16
  b, h, nc = 2, 2, 3 if k_dim == 16 else 4
  t = nc * chunk
  x = _walk_inputs(1, b, h, t, k_dim, v_dim, chunk, dtype)
  q, k, v, beta = (x[n] for n in ("q", "k", "v", "beta"))
  pad = lambda s: jnp.pad(s, ((0, 0), (0, 0), (0, 0), (0, k_state - k_dim)))
  m_starts, b_starts = pad(x["m_starts"]), pad(x["b_starts"])
  ip = x["ip_row"][:, 0]
  ip_rows = jnp.broadcast_to(ip[:, None], (b * h, k_dim))
  want = walk_forward_triton.walk_forward(q, k, v, beta, x["a"], ip_rows, m_starts, b_starts,
                                          heads=h, chunk=chunk, block_v=16, unroll=2, k_part=16,
                                          with_var=with_var, out_dtype=dtype, num_warps=1,
                                          interpret=interpret)
  got = walk_forward_mosaic.walk_forward(q, k, v, beta, x["a"], ip, m_starts, b_starts,
                                         heads=h, chunk=chunk, with_var=with_var,
                                         out_dtype=dtype, interpret=interpret)
  assert len(got) == len(want) == 1 + with_var
  for name, g, w in zip(("out", "var"), got, want):
    chex.assert_equal_shape([g, w], custom_message=name)
    g, w = g.astype(jnp.float32), w.astype(jnp.float32)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bfloat16 outputs: one rounding each.
    chex.assert_trees_all_close(g, w, rtol=tol, atol=tol * float(jnp.max(jnp.abs(w))),
                                custom_message=name)


@pytest.mark.parametrize("shape, with_var, dtype", [
    ((4, 4096, 16, 96, 192), False, jnp.bfloat16), ((2, 1024, 8, 16, 32), True, jnp.bfloat16),
    ((1, 4096, 20, 128, 256), False, jnp.bfloat16), ((2, 300, 3, 48, 96), True, jnp.bfloat16),
    ((2, 512, 8, 16, 32), False, jnp.float32)])
def test_hopper_path_lowers_to_mosaic_gpu_only(monkeypatch, shape, with_var, dtype):
  """On Hopper (sm_90) a compiled forward+backward at D760, MQAR, 2.7B and D170-like heads
  (with the variance, and T not a multiple of the chunk), and MQAR's paper step in float32,
  lowers on a CPU host to Mosaic GPU kernels alone: none through Pallas' deprecated Triton
  lowering."""
  monkeypatch.setattr(gpu_config, "compute_capability", lambda: (9, 0))
  b, t, h, kd, vd = shape
  sds, f32 = jax.ShapeDtypeStruct, jnp.float32
  args = [sds((b, t, h, kd), dtype)] * 2 + [sds((b, t, h, vd), dtype)] * 2 + [
      sds((b, t, h), f32), sds((h,), f32)] + [sds((b, h, vd, kd), f32)] * 2
  cfg = make_config(*args[:1], args[2], args[4], args[5], return_variance=with_var,
                    chunk_size=64, interpret=False)
  assert cfg.backends == ("mosaic",) * 4

  def loss(*a):
    out, var, mu, prec = op_module._palimpsa(cfg, *a, None)
    total = jnp.sum(out.astype(f32)) + jnp.sum(mu) + jnp.sum(prec)
    return total + jnp.sum(var) if with_var else total

  grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(8))))
  text = grad.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  # Five kernels: the forward's boundary and walk; the backward's boundary again (its
  # chunk-start states are recomputed, not kept), walk and carries.
  assert text.count("custom_call @mosaic_gpu") == 5 and "triton" not in text.lower()


def test_forward_makes_no_layout_copies(monkeypatch):
  """The forward's kernels read q, k, v and beta where they lie and it keeps no copy for the
  backward: lowered for Hopper on the CPU (T not a multiple of the chunk, with the
  variance), the forward of a vjp, residuals included, transposes only log_alpha's
  [B, T, H] into the per-head gates."""
  monkeypatch.setattr(gpu_config, "compute_capability", lambda: (9, 0))
  b, t, h, kd, vd = 2, 300, 3, 48, 96
  sds, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
  args = [sds((b, t, h, kd), bf16)] * 2 + [sds((b, t, h, vd), bf16)] * 2 + [
      sds((b, t, h), f32), sds((h,), f32)] + [sds((b, h, vd, kd), f32)] * 2
  cfg = make_config(*args[:1], args[2], args[4], args[5], return_variance=True,
                    chunk_size=64, interpret=False)
  op = lambda *a: op_module._palimpsa(cfg, *a, None)
  forward = jax.jit(lambda *a: jax.vjp(op, *a))  # The outputs and the residuals.
  text = forward.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  transposes = re.findall(r"stablehlo.transpose .*: \((tensor<[^>]*>)\)", text)
  assert transposes == [f"tensor<{b}x{t}x{h}xf32>"], transposes

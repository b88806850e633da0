"""Short conv, norms, RoPE, SwiGLU and initialisers against direct formulas."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from palimpsa_jax.layers import (GatedRMSNorm, RMSNorm, ShortConv, SwiGLU,
                                 apply_rope, swiglu_hidden_dim)
from palimpsa_jax.layers import conv as conv_lib
from palimpsa_jax.layers import params as params_lib
from palimpsa_jax.layers.diagnostics import palimpsa_diagnostics
from palimpsa_jax.layers.norms import gated_rms_norm
from palimpsa_jax.ops import PalimpsaResult, PalimpsaState
from tests.ops.numerics import BFLOAT16_TOL, FLOAT32_TOL, assert_close_to_reference


def _conv_reference(x, w, b, seg):
  """Causal depthwise conv in float64, restarting at segment changes."""
  batch, length, _ = x.shape
  width = w.shape[0]
  y = np.zeros(x.shape)
  for bi in range(batch):
    for t in range(length):
      for i in range(width):
        src = t - (width - 1) + i
        if src >= 0 and seg[bi, src] == seg[bi, t]:
          y[bi, t] += w[i] * x[bi, src]
  y = y + (0 if b is None else b)
  return y / (1 + np.exp(-y))


@pytest.mark.parametrize("use_bias", [False, True])
def test_short_conv_matches_reference_with_segments(use_bias):
  conv = ShortConv(6, 4, rngs=nnx.Rngs(0), use_bias=use_bias)
  x = jax.random.normal(jax.random.key(1), (2, 9, 6))
  seg = jnp.array([[0] * 4 + [1] * 5, [0] * 9])
  y, _ = conv(x, segment_ids=seg)
  b = None if conv.bias is None else np.asarray(conv.bias[...], np.float64)
  ref = _conv_reference(np.asarray(x, np.float64),
                        np.asarray(conv.kernel[...], np.float64), b,
                        np.asarray(seg))
  chex.assert_trees_all_close(np.asarray(y), ref, rtol=1e-5, atol=1e-6)


def test_short_conv_state_continues_the_sequence():
  conv = ShortConv(5, 4, rngs=nnx.Rngs(0), use_bias=True)
  x = jax.random.normal(jax.random.key(2), (2, 10, 5))
  full, full_state = conv(x)
  first, state = conv(x[:, :3])
  second, state = conv(x[:, 3:4], state)
  third, state = conv(x[:, 4:], state)
  chex.assert_trees_all_close(
      np.concatenate([first, second, third], 1), full, rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_equal(state, full_state)
  assert state.shape == (2, 3, 5) and state.dtype == jnp.float32


def _autodiff_conv(x, halo, halo_ids, segment_ids, kernel, bias, activation, dtype):
  """The short conv's plain float32 formula, differentiated by autodiff."""
  length, width = x.shape[1], kernel.shape[0]
  padded = jnp.concatenate([halo, x.astype(jnp.float32)], axis=1)
  y = 0.0
  for i in range(width):
    tap = padded[:, i:i + length] * kernel[i]
    if segment_ids is not None and i < width - 1:
      ids = jnp.concatenate([halo_ids, segment_ids], axis=1)
      tap = jnp.where((ids[:, i:i + length] == segment_ids)[..., None], tap, 0.0)
    y = y + tap
  y = y if bias is None else y + bias
  return (jax.nn.silu(y) if activation else y).astype(dtype)


@pytest.mark.parametrize("width,length,segments,use_bias,activation,dtype", [
    (4, 11, True, True, True, "float32"), (4, 11, False, False, True, "float32"),
    (4, 2, True, True, True, "float32"), (2, 7, True, False, False, "float32"),
    (1, 5, False, True, True, "float32"), (4, 11, True, False, True, "bfloat16")])
def test_short_conv_gradients_match_autodiff(width, length, segments, use_bias, activation,
                                             dtype):
  """The conv's hand-written backward against autodiff of its formula: every cotangent
  (x, the halo of inputs before x, kernel, bias), with segments and a nonzero halo."""
  dtype = jnp.dtype(dtype)
  keys = jax.random.split(jax.random.key(4), 5)
  x = jax.random.normal(keys[0], (2, length, 6)).astype(dtype)
  halo = jax.random.normal(keys[1], (2, width - 1, 6))
  kernel = jax.random.normal(keys[2], (width, 6))
  bias = jax.random.normal(keys[3], (6,)) if use_bias else None
  dy = jax.random.normal(keys[4], x.shape).astype(dtype)
  seg = ids = None
  if segments:
    seg = jnp.array([[0] * (length // 2) + [1] * (length - length // 2), [3] * length])
    ids = jnp.array([[0] * (width - 1), [2] * (width - 1)])

  def output_and_grads(fn):
    args = (x, halo, kernel) + (() if bias is None else (bias,))
    run = lambda x, halo, kernel, *b: fn(x, halo, ids, seg, kernel, b[0] if b else None,
                                         activation=activation, dtype=dtype)
    y, vjp = jax.vjp(run, *args)
    return jax.jit(lambda: (y, *vjp(dy)))()

  got = output_and_grads(conv_lib._convolve)
  want = output_and_grads(
      lambda *a, activation, dtype: _autodiff_conv(*a, activation, dtype))
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  names = ("y", "dx", "dhalo", "dkernel", "dbias")
  tol = FLOAT32_TOL if dtype == jnp.float32 else BFLOAT16_TOL
  assert_close_to_reference(dict(zip(names, got)), dict(zip(names, want)), tol)


def test_short_conv_rejects_wrong_channels():
  conv = ShortConv(5, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"x must be \[B, T, 5\]"):
    conv(jnp.zeros((1, 3, 4)))


def test_rms_norm_and_dtype():
  norm = RMSNorm(8, eps=1e-5, dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.key(3), (3, 8)) * 5
  y = norm(x)
  ref = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)
  assert y.dtype == jnp.bfloat16 and norm.scale[...].dtype == jnp.float32
  chex.assert_trees_all_close(np.asarray(y, np.float32), ref, rtol=1e-2)


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_rms_norm_groups(norm_before_gate):
  norm = GatedRMSNorm(8, group_size=4, norm_before_gate=norm_before_gate,
                      eps=1e-6)
  norm.scale[...] = jnp.arange(1.0, 9.0)
  x = np.random.default_rng(0).normal(size=(2, 8))
  z = np.random.default_rng(1).normal(size=(2, 8))
  y = norm(jnp.asarray(x, jnp.float32), jnp.asarray(z, jnp.float32))
  gate = z / (1 + np.exp(-z))
  pre = x if norm_before_gate else x * gate
  groups = pre.reshape(2, 2, 4)
  normed = (groups / np.sqrt(np.mean(groups ** 2, -1, keepdims=True) + 1e-6)
            ).reshape(2, 8) * np.arange(1.0, 9.0)
  ref = normed * gate if norm_before_gate else normed
  chex.assert_trees_all_close(np.asarray(y), ref, rtol=1e-5, atol=1e-6)


def test_rope_scores_depend_on_relative_position_only():
  q = jax.random.normal(jax.random.key(4), (1, 1, 2, 8))
  k = jax.random.normal(jax.random.key(5), (1, 1, 2, 8))
  def score(pq, pk):
    return jnp.sum(apply_rope(q, jnp.array([pq])) * apply_rope(k, jnp.array([pk])), -1)
  chex.assert_trees_all_close(score(7, 3), score(104, 100), rtol=1e-4)
  chex.assert_trees_all_close(score(0, 0), jnp.sum(q * k, -1), rtol=1e-5)
  assert not np.allclose(score(7, 3), score(3, 7))


def test_swiglu_shape_and_hidden_rule():
  assert swiglu_hidden_dim(768) == 2048
  assert swiglu_hidden_dim(1536) == 4096
  mlp = SwiGLU(8, 16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(6), (2, 3, 8))
  ref = (jax.nn.silu(x @ mlp.gate_proj.kernel[...]) * (x @ mlp.up_proj.kernel[...])
         ) @ mlp.down_proj.kernel[...]
  chex.assert_trees_all_close(mlp(x), ref, rtol=1e-5, atol=1e-7)


def test_swiglu_init_std():
  mlp = SwiGLU(64, 128, rngs=nnx.Rngs(0), init_std=0.5)
  for dense in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
    chex.assert_trees_all_close(float(jnp.std(dense.kernel[...])), 0.5, rtol=0.05)


def test_a_log_initialisers():
  key = jax.random.key(7)
  a = jnp.exp(params_lib.init_a_log(key, 64, "uniform", (0.0, 16.0)))
  assert float(a.min()) > 0 and float(a.max()) < 16
  chex.assert_trees_all_close(
      jnp.exp(params_lib.init_a_log(key, 5, "arange", (1.0, 16.0))),
      np.array([1, 2, 3, 4, 5.0]), rtol=1e-6)
  chex.assert_trees_all_close(
      jnp.exp(params_lib.init_a_log(key, 4, "linspace", (0.01, 0.16))),
      np.array([0.01, 0.06, 0.11, 0.16]), rtol=1e-5)
  with pytest.raises(ValueError, match="A_init"):
    params_lib.init_a_log(key, 4, "normal", (0.0, 1.0))


def test_dt_bias_is_inverse_softplus_of_log_uniform_dt():
  dt = jax.nn.softplus(
      params_lib.init_dt_bias(jax.random.key(8), 20000, 1e-3, 1e-1, 1e-4))
  assert float(dt.min()) >= 1e-3 * (1 - 1e-4)
  assert float(dt.max()) <= 1e-1 * (1 + 1e-4)
  log_dt = np.log(np.asarray(dt, np.float64))
  lo, hi = math.log(1e-3), math.log(1e-1)
  assert abs(log_dt.mean() - (lo + hi) / 2) < 0.05
  assert abs(log_dt.std() - (hi - lo) / math.sqrt(12)) < 0.05


def test_make_param_checks_names():
  with pytest.raises(ValueError, match="must name every axis"):
    params_lib.make_param(jnp.zeros((2, 3)), ("embed",))
  with pytest.raises(ValueError, match="not in"):
    params_lib.make_param(jnp.zeros((2,)), ("batch",))


def test_palimpsa_diagnostics_summaries():
  precision = jnp.array([1.0, 1.5, 2.5, 4.0]).reshape(1, 1, 2, 2)
  variance = jnp.array([0.5, 1.5]).reshape(1, 1, 1, 2)
  result = PalimpsaResult(jnp.zeros((1, 1, 1, 2)), variance,
                          PalimpsaState(jnp.zeros_like(precision), precision))
  q = jnp.ones((1, 1, 1, 2))
  stats = palimpsa_diagnostics(result, q, jnp.ones((1,)), jnp.full((2,), 3.0))
  chex.assert_trees_all_close(stats["metaplastic_fraction"], 0.5, rtol=1e-7)
  chex.assert_trees_all_close(stats["precision_mean"], 2.25, rtol=1e-7)
  chex.assert_trees_all_close(stats["variance_mean"], 1.0, rtol=1e-7)
  chex.assert_trees_all_close(stats["output_rms"], 3.0, rtol=1e-7)
  no_variance = result._replace(variance=None)
  stats = palimpsa_diagnostics(no_variance, q, jnp.full((1,), 2.0),
                               jnp.zeros(2))
  chex.assert_trees_all_close(stats["variance_mean"], 1.0, rtol=1e-7)  # sum q^2 / Ip


def _autodiff_gated_norm(x, gate, scale, group_size, eps, norm_before_gate, dtype):
  """The gated norm as plain JAX (what autodiff differentiates without a custom VJP)."""
  x = x.astype(jnp.float32)
  gate = jax.nn.silu(gate.astype(jnp.float32))
  if not norm_before_gate:
    x = x * gate
  grouped = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
  normed = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, -1, keepdims=True) + eps)
  y = normed.reshape(x.shape) * scale
  return (y * gate if norm_before_gate else y).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_rms_norm_gradients_match_autodiff(norm_before_gate, dtype):
  """The custom VJP against autodiff of the plain form: output and all three gradients."""
  dtype = jnp.dtype(dtype)
  keys = jax.random.split(jax.random.key(7), 4)
  x = 3 * jax.random.normal(keys[0], (2, 5, 3, 8))  # float32, as the mixers pass it.
  gate = jax.random.normal(keys[1], (2, 5, 3, 8)).astype(dtype)
  scale = 1 + 0.3 * jax.random.normal(keys[2], (8,))
  dy = jax.random.normal(keys[3], x.shape).astype(dtype)
  args = (4, 1e-5, norm_before_gate, dtype)

  def output_and_grads(fn):
    y, vjp = jax.vjp(lambda *a: fn(*a, *args), x, gate, scale)
    return jax.jit(lambda: (y, *vjp(dy)))()

  got = output_and_grads(gated_rms_norm)
  want = output_and_grads(_autodiff_gated_norm)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  names = ("y", "dx", "dgate", "dscale")
  tol = FLOAT32_TOL if dtype == jnp.float32 else BFLOAT16_TOL
  assert_close_to_reference(dict(zip(names, got)), dict(zip(names, want)), tol)

"""Every mixer: shapes, segments, decoding == forward, gradients, equivalences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from palimpsa_jax.layers import palimpsa_d as palimpsa_d_module
from palimpsa_jax.models import make_mixer, model_config

MODELS = ("palimpsa_d", "not_palimpsa", "meta_mamba2", "mamba2",
          "gated_deltanet", "transformer")
BATCH, LENGTH, PREFIX = 2, 12, 5


def _config(model):
  return model_config(model, "tiny", dtype="float32", chunk_size=4)


def _mixer(model, seed=0):
  return make_mixer(_config(model), nnx.Rngs(seed))


def _perturb(module, seed, scale=0.1):
  """Adds noise to every parameter (frozen Ip_log excepted)."""
  flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
  keys = jax.random.split(jax.random.key(seed), len(flat))
  updated = []
  for key, (path, var) in zip(keys, flat):
    value = var[...]
    if path[-1] != "Ip_log":
      value = value + scale * jax.random.normal(key, value.shape)
    updated.append((path, var.replace(value)))
  nnx.update(module, nnx.from_flat_state(updated))


def _assert_close(actual, expected, tol):
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.shape == expected.shape
  scale = np.max(np.abs(expected))
  err = np.max(np.abs(actual - expected))
  assert err <= tol * scale, f"max err {err:.3g} > {tol} * {scale:.3g}"


@nnx.jit
def _forwards(mixer, x, segment_ids):
  y, diagnostics = mixer(x, return_diagnostics=True)
  packed = mixer(x, segment_ids=segment_ids)
  alone = mixer(x[:, PREFIX:])
  return y, diagnostics, packed, alone


@nnx.jit
def _prefill(mixer, x, cache):
  return mixer.prefill(x, cache)


@nnx.jit
def _step(mixer, x, cache):
  return mixer.step(x, cache)


@nnx.jit
def _grads(mixer, x, w):
  return nnx.grad(lambda m: jnp.sum(m(x) * w))(mixer)


@pytest.fixture(scope="module", params=MODELS)
def case(request):
  mixer = _mixer(request.param)
  _perturb(mixer, 1)
  x = jax.random.normal(jax.random.key(2), (BATCH, LENGTH, 64))
  segment_ids = jnp.array([[0] * PREFIX + [1] * (LENGTH - PREFIX)] * BATCH)
  return request.param, mixer, x, _forwards(mixer, x, segment_ids)


def test_shapes_dtypes_and_diagnostics(case):
  model, mixer, x, (y, diagnostics, _, _) = case
  assert y.shape == x.shape and y.dtype == jnp.float32
  assert np.all(np.isfinite(y))
  for leaf in jax.tree.leaves(nnx.state(mixer, nnx.Param)):
    assert leaf.dtype == jnp.float32
  assert "output_rms" in diagnostics
  if model in ("palimpsa_d", "not_palimpsa", "meta_mamba2", "mamba2"):
    for key in ("variance_mean", "precision_mean", "precision_std",
                "metaplastic_fraction"):
      assert np.isfinite(diagnostics[key]), key
    assert 0 <= diagnostics["metaplastic_fraction"] <= 1
    if model in ("not_palimpsa", "mamba2"):
      np.testing.assert_allclose(diagnostics["precision_mean"], 1.0, rtol=1e-6)


def test_segments_restart_every_mixer(case):
  _, _, _, (y, _, packed, alone) = case
  _assert_close(packed[:, :PREFIX], y[:, :PREFIX], 1e-5)
  _assert_close(packed[:, PREFIX:], alone, 1e-5)


def test_prefill_then_steps_equal_forward(case):
  _, mixer, x, (y, _, _, _) = case
  cache = mixer.init_cache(BATCH, LENGTH, jnp.float32)
  shapes = jax.tree.map(lambda a: (a.shape, a.dtype), cache)
  outputs = []
  out, cache = _prefill(mixer, x[:, :PREFIX], cache)
  outputs.append(out)
  for t in range(PREFIX, LENGTH):
    out, cache = _step(mixer, x[:, t:t + 1], cache)
    outputs.append(out)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), cache) == shapes
  _assert_close(jnp.concatenate(outputs, axis=1), y, 1e-4)


def test_gradients_finite_and_ip_frozen(case):
  model, mixer, x, _ = case
  w = jax.random.normal(jax.random.key(3), x.shape)
  grads = _grads(mixer, x, w)
  flat = dict(nnx.to_flat_state(grads))
  for path, g in flat.items():
    value = np.asarray(g[...])
    assert np.all(np.isfinite(value)), path
    if path[-1] == "Ip_log":
      np.testing.assert_array_equal(value, 0.0)
    else:
      assert np.any(value != 0), path
  has_beta = any(p[0] in ("beta_up", "b_scale") for p in flat)
  assert has_beta == (model in ("palimpsa_d", "meta_mamba2"))


def test_not_palimpsa_equals_palimpsa_d_with_zero_beta(monkeypatch):
  full, plain = _mixer("palimpsa_d"), _mixer("not_palimpsa", seed=5)
  _perturb(full, 4)
  source = dict(nnx.to_flat_state(nnx.state(full, nnx.Param)))
  shared = [(path, source[path])
            for path, _ in nnx.to_flat_state(nnx.state(plain, nnx.Param))]
  nnx.update(plain, nnx.from_flat_state(shared))
  full.beta_up.kernel[...] = jnp.zeros_like(full.beta_up.kernel[...])
  full.beta_up.bias[...] = jnp.full_like(full.beta_up.bias[...], -1e4)
  x = jax.random.normal(jax.random.key(6), (BATCH, LENGTH, 64))
  _assert_close(nnx.jit(lambda m, x: m(x))(plain, x),
                nnx.jit(lambda m, x: m(x))(full, x), 1e-5)

  betas = []
  original = palimpsa_d_module.palimpsa
  def recording_palimpsa(*args, **kwargs):
    betas.append(args[3])
    return original(*args, **kwargs)
  monkeypatch.setattr(palimpsa_d_module, "palimpsa", recording_palimpsa)
  nnx.eval_shape(lambda m: m(x), plain)
  assert betas == [None]  # NotPalimpsa asks the op for its SimpleGLA path.


def _mamba2_reference(p, x, heads, head_dim, state_dim, groups, eps):
  """Minimal Mamba2 mixer in float64 numpy, written from the Mamba2 paper."""
  silu = lambda a: a / (1 + np.exp(-a))
  softplus = lambda a: np.log1p(np.exp(a))
  batch, length, _ = x.shape
  d_inner = heads * head_dim
  zxbcdt = x @ p["in_proj"]
  z = zxbcdt[..., :d_inner]
  xbc = zxbcdt[..., d_inner:2 * d_inner + 2 * groups * state_dim]
  dt = zxbcdt[..., 2 * d_inner + 2 * groups * state_dim:]
  width = p["conv_w"].shape[0]
  padded = np.concatenate([np.zeros((batch, width - 1, xbc.shape[-1])), xbc], 1)
  conv = sum(p["conv_w"][i] * padded[:, i:i + length] for i in range(width))
  xbc = silu(conv + p["conv_b"])
  xs = xbc[..., :d_inner].reshape(batch, length, heads, head_dim)
  b = xbc[..., d_inner:d_inner + groups * state_dim].reshape(
      batch, length, groups, state_dim)
  c = xbc[..., d_inner + groups * state_dim:].reshape(
      batch, length, groups, state_dim)
  dt = softplus(dt + p["dt_bias"])
  a = -np.exp(p["A_log"])
  group_of_head = np.arange(heads) // (heads // groups)
  h = np.zeros((batch, heads, head_dim, state_dim))
  y = np.zeros((batch, length, heads, head_dim))
  for t in range(length):
    decay = np.exp(dt[:, t] * a)[:, :, None, None]
    bt, ct = b[:, t, group_of_head], c[:, t, group_of_head]
    h = decay * h + (dt[:, t, :, None] * xs[:, t])[..., None] * bt[:, :, None]
    y[:, t] = np.einsum("bhpn,bhn->bhp", h, ct) + p["D"][:, None] * xs[:, t]
  y = y.reshape(batch, length, d_inner) * silu(z)
  grouped = y.reshape(batch, length, groups, d_inner // groups)
  y = grouped / np.sqrt(np.mean(grouped ** 2, -1, keepdims=True) + eps)
  y = y.reshape(batch, length, d_inner) * p["norm"]
  return y @ p["out_proj"]


def test_mamba2_equals_minimal_mamba2():
  mixer = _mixer("mamba2")
  _perturb(mixer, 7)
  get = lambda v: np.asarray(v[...], np.float64)
  params = {"in_proj": get(mixer.in_proj.kernel),
            "conv_w": get(mixer.conv.kernel), "conv_b": get(mixer.conv.bias),
            "dt_bias": get(mixer.dt_bias), "A_log": get(mixer.A_log),
            "D": get(mixer.D), "norm": get(mixer.norm.scale),
            "out_proj": get(mixer.out_proj.kernel)}
  x = jax.random.normal(jax.random.key(8), (BATCH, LENGTH, 64))
  config = _config("mamba2")
  expected = _mamba2_reference(
      params, np.asarray(x, np.float64), mixer.num_heads, config.head_dim,
      config.state_dim, config.num_groups, config.norm_eps)
  _assert_close(nnx.jit(lambda m, x: m(x))(mixer, x), expected, 1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_bad_input_raises(model):
  mixer = nnx.eval_shape(lambda: _mixer(model))
  with pytest.raises(ValueError, match=r"x must be \[B, T, 64\]"):
    nnx.eval_shape(lambda m: m(jnp.zeros((2, 3, 32))), mixer)
  with pytest.raises(TypeError, match="floating point"):
    nnx.eval_shape(lambda m: m(jnp.zeros((2, 3, 64), jnp.int32)), mixer)

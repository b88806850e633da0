"""Every mixer: shapes, segments, decoding == forward, gradients, equivalences."""

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from palimpsa_jax.layers import recurrent as recurrent_module
from palimpsa_jax.models import make_mixer, model_config, registry
from tests.ops.numerics import FLOAT32_TOL, assert_close_to_reference

MODELS = tuple(registry.MIXERS)  # every registered mixer
BATCH, LENGTH, PREFIX = 2, 12, 5


def _config(model):
  # The metaplastic mixers keep the beta up-projection's bias here (the general form; the
  # language models' default leaves it out): the references and the zero-beta test use it.
  extra = dict(beta_bias=True) if model in ("palimpsa_d", "meta_mamba2") else {}
  return model_config(model, "tiny", dtype="float32", chunk_size=4, **extra)


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


def _apply(mixer, x):
  return mixer(x)


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
  chex.assert_shape(y, x.shape)
  chex.assert_type(y, jnp.float32)
  chex.assert_tree_all_finite(y)
  chex.assert_type(jax.tree.leaves(nnx.state(mixer, nnx.Param)), jnp.float32)
  assert "output_rms" in diagnostics
  registered = registry.MIXERS[model]
  if registry.KINDS[registered.kind].metaplastic:  # the Palimpsa family
    chex.assert_tree_all_finite({key: diagnostics[key] for key in (
        "variance_mean", "precision_mean", "precision_std", "metaplastic_fraction")})
    assert 0 <= diagnostics["metaplastic_fraction"] <= 1
    if not registered.metaplasticity:
      chex.assert_trees_all_close(diagnostics["precision_mean"], 1.0, rtol=1e-6)


def test_segments_restart_every_mixer(case):
  _, _, _, (y, _, packed, alone) = case
  assert_close_to_reference(packed[:, :PREFIX], y[:, :PREFIX], FLOAT32_TOL)
  assert_close_to_reference(packed[:, PREFIX:], alone, FLOAT32_TOL)


def test_prefill_then_steps_equal_forward(case):
  _, mixer, x, (y, _, _, _) = case
  initial = mixer.init_cache(BATCH, LENGTH, jnp.float32)
  outputs = []
  out, cache = _prefill(mixer, x[:, :PREFIX], initial)
  outputs.append(out)
  for t in range(PREFIX, LENGTH):
    out, cache = _step(mixer, x[:, t:t + 1], cache)
    outputs.append(out)
  chex.assert_trees_all_equal_shapes_and_dtypes(cache, initial)
  assert_close_to_reference(jnp.concatenate(outputs, axis=1), y, 1e-4)


def test_gradients_finite_and_ip_frozen(case):
  model, mixer, x, _ = case
  w = jax.random.normal(jax.random.key(3), x.shape)
  grads = _grads(mixer, x, w)
  flat = dict(nnx.to_flat_state(grads))
  chex.assert_tree_all_finite({"/".join(map(str, path)): g[...] for path, g in flat.items()})
  for path, g in flat.items():
    value = np.asarray(g[...])
    if path[-1] == "Ip_log":
      chex.assert_trees_all_equal(value, np.zeros_like(value))
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
  assert_close_to_reference(nnx.jit(_apply)(plain, x), nnx.jit(_apply)(full, x), FLOAT32_TOL)

  betas = []
  original = recurrent_module.palimpsa
  def recording_palimpsa(*args, **kwargs):
    betas.append(args[3])
    return original(*args, **kwargs)
  monkeypatch.setattr(recurrent_module, "palimpsa", recording_palimpsa)
  nnx.eval_shape(lambda m: m(x), plain)
  assert betas == [None]  # NotPalimpsa asks the op for its SimpleGLA path.


def _silu(a):
  return a / (1 + np.exp(-a))


def _softplus(a):
  return np.logaddexp(0.0, a)


def _sigmoid(a):
  return 1 / (1 + np.exp(-a))


def _causal_silu_conv(x, kernel, bias=None):
  """Depthwise causal conv + SiLU: x [B, T, C], kernel [W, C] -> [B, T, C].

  y[t] = sum_i kernel[i] * x[t - (W - 1) + i] (+ bias), zeros before t = 0.
  """
  length, width = x.shape[1], kernel.shape[0]
  y = np.zeros_like(x)
  for t in range(length):
    for i in range(width):
      source = t - (width - 1) + i
      if source >= 0:
        y[:, t] += kernel[i] * x[:, source]
  return _silu(y if bias is None else y + bias)


def _mamba2_inputs(p, x, heads, head_dim, state_dim, groups):
  """in_proj -> (z [B,T,P*H], x [B,T,H,P], B and C per head [B,T,H,N], raw dt [B,T,H])."""
  batch, length, _ = x.shape
  d_inner = heads * head_dim
  zxbcdt = x @ p["in_proj"]
  z = zxbcdt[..., :d_inner]
  xbc = zxbcdt[..., d_inner:2 * d_inner + 2 * groups * state_dim]
  dt = zxbcdt[..., 2 * d_inner + 2 * groups * state_dim:]
  xbc = _causal_silu_conv(xbc, p["conv_w"], p["conv_b"])
  xs = xbc[..., :d_inner].reshape(batch, length, heads, head_dim)
  group_of_head = np.arange(heads) // (heads // groups)
  b = xbc[..., d_inner:d_inner + groups * state_dim].reshape(
      batch, length, groups, state_dim)[:, :, group_of_head]
  c = xbc[..., d_inner + groups * state_dim:].reshape(
      batch, length, groups, state_dim)[:, :, group_of_head]
  return z, xs, b, c, dt


def _mamba2_reference(p, x, heads, head_dim, state_dim, groups, eps):
  """Minimal Mamba2 mixer in float64 numpy, written from the Mamba2 paper."""
  batch, length, _ = x.shape
  d_inner = heads * head_dim
  z, xs, b, c, dt = _mamba2_inputs(p, x, heads, head_dim, state_dim, groups)
  dt = _softplus(dt + p["dt_bias"])
  a = -np.exp(p["A_log"])
  h = np.zeros((batch, heads, head_dim, state_dim))
  y = np.zeros((batch, length, heads, head_dim))
  for t in range(length):
    decay = np.exp(dt[:, t] * a)[:, :, None, None]
    h = decay * h + (dt[:, t, :, None] * xs[:, t])[..., None] * b[:, t, :, None]
    y[:, t] = np.einsum("bhpn,bhn->bhp", h, c[:, t]) + p["D"][:, None] * xs[:, t]
  y = y.reshape(batch, length, d_inner) * _silu(z)
  grouped = y.reshape(batch, length, groups, d_inner // groups)
  y = grouped / np.sqrt(np.mean(grouped ** 2, -1, keepdims=True) + eps)
  y = y.reshape(batch, length, d_inner) * p["norm"]
  return y @ p["out_proj"]


def _mamba2_case():
  """(Mamba2 mixer, x, its float64 reference output)."""
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
  return mixer, x, expected


@pytest.mark.parametrize("model", MODELS)
def test_bad_input_raises(model):
  mixer = nnx.eval_shape(lambda: _mixer(model))
  with pytest.raises(ValueError, match=r"x must be \[B, T, 64\]"):
    nnx.eval_shape(lambda m: m(jnp.zeros((2, 3, 32))), mixer)
  with pytest.raises(TypeError, match="floating point"):
    nnx.eval_shape(lambda m: m(jnp.zeros((2, 3, 64), jnp.int32)), mixer)


def _palimpsa_steps(q, k, v, beta, log_alpha, ip):
  """docs/math.md stepped token by token in the (mu, I) form.

  q, k [B, T, H, K]; v, beta [B, T, H, V]; log_alpha [B, T, H]; ip [H].
  Returns o [B, T, H, V] with o_t = mu_t q_t.
  """
  batch, length, heads, key_dim = k.shape
  value_dim = v.shape[-1]
  ip = ip[None, :, None, None]
  mu = np.zeros((batch, heads, value_dim, key_dim))
  precision = np.broadcast_to(ip, mu.shape)
  out = np.zeros((batch, length, heads, value_dim))
  for t in range(length):
    alpha = np.exp(log_alpha[:, t])[:, :, None, None]
    kt = k[:, t, :, None, :]
    new_precision = (alpha * precision + (1 - alpha) * ip
                     + beta[:, t, :, :, None] * kt ** 2)
    mu = (alpha * (precision / new_precision) * mu
          + v[:, t, :, :, None] * kt / new_precision)
    precision = new_precision
    out[:, t] = np.einsum("bhvk,bhk->bhv", mu, q[:, t])
  return out


def _rms(x, eps):
  return x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + eps)


def _palimpsa_d_reference(p, x, heads, key_dim, value_dim, eps):
  """Palimpsa-D (docs/models.md, layers) in float64 numpy; x [B, T, d] -> [B, T, d]."""
  batch, length, _ = x.shape
  per_head = lambda a, dim: a.reshape(batch, length, heads, dim)
  l2 = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
  q = l2(per_head(_causal_silu_conv(x @ p["q_proj"], p["q_conv"]), key_dim))
  q = q * key_dim ** -0.5
  k = l2(per_head(_causal_silu_conv(x @ p["k_proj"], p["k_conv"]), key_dim))
  v = per_head(_causal_silu_conv(x @ p["v_proj"], p["v_conv"]), value_dim)
  dt = _softplus(x @ p["dt_proj"] + p["dt_bias"])
  log_alpha = -np.exp(p["A_log"]) * dt
  s = _sigmoid(x @ p["s_proj"])[..., None]
  gate = _sigmoid((x @ p["beta_down"]) @ p["beta_up"] + p["beta_up_bias"])
  beta = per_head(gate, value_dim) * _softplus(p["b_scale"])[:, None] * s
  out = _palimpsa_steps(q, k, v * s, beta, log_alpha, np.exp(p["Ip_log"]))
  out = out + p["D"][:, None] * v
  out = _rms(out, eps) * p["norm"] * _silu(
      per_head(x @ p["gate_proj"], value_dim))
  return out.reshape(batch, length, heads * value_dim) @ p["out_proj"]


def _meta_mamba2_reference(p, x, heads, head_dim, state_dim, groups, eps):
  """MetaMamba2 (docs/models.md, layers, Palimpsa-M) in float64 numpy."""
  batch, length, _ = x.shape
  d_inner = heads * head_dim
  z, xs, b, c, dt = _mamba2_inputs(p, x, heads, head_dim, state_dim, groups)
  dt = _softplus(dt + p["dt_bias"])
  log_alpha = -np.exp(p["A_log"]) * dt
  gate = _sigmoid((x @ p["beta_down"]) @ p["beta_up"] + p["beta_up_bias"])
  beta = (gate.reshape(batch, length, heads, head_dim)
          * _softplus(p["b_scale"])[:, None] * dt[..., None])
  y = _palimpsa_steps(c, b, xs * dt[..., None], beta, log_alpha,
                      np.exp(p["Ip_log"]))
  y = (y + p["D"][:, None] * xs).reshape(batch, length, d_inner) * _silu(z)
  y = _rms(y.reshape(batch, length, groups, d_inner // groups), eps)
  y = y.reshape(batch, length, d_inner) * p["norm"]
  return y @ p["out_proj"]


def _set_head_params(mixer, seed, b_scale_raw):
  """Draws per-head parameters so that every term of the layer matters.

  A in [0.3, 3], dt around softplus(-1), D in [0.3, 1.7], Ip in [0.5, 2],
  softplus(b_scale) ~ b_scale_raw (beta of order 1 against Ip).
  """
  keys = jax.random.split(jax.random.key(seed), 5)
  heads = mixer.num_heads
  uniform = lambda key, lo, hi: jax.random.uniform(key, (heads,), jnp.float32,
                                                   lo, hi)
  mixer.A_log[...] = jnp.log(uniform(keys[0], 0.3, 3.0))
  mixer.dt_bias[...] = uniform(keys[1], -1.5, -0.5)
  mixer.D[...] = uniform(keys[2], 0.3, 1.7)
  mixer.Ip_log[...] = jnp.log(uniform(keys[3], 0.5, 2.0))
  mixer.b_scale[...] = b_scale_raw + uniform(keys[4], -0.5, 0.5)


def _float64(variable):
  return np.asarray(variable[...], np.float64)


def _palimpsa_d_case():
  """(Palimpsa-D mixer, x, its float64 reference output)."""
  mixer = _mixer("palimpsa_d")
  _perturb(mixer, 9, scale=0.2)
  _set_head_params(mixer, 10, b_scale_raw=3.0)
  m = mixer
  params = {
      "q_proj": _float64(m.q_proj.kernel), "k_proj": _float64(m.k_proj.kernel),
      "v_proj": _float64(m.v_proj.kernel), "q_conv": _float64(m.q_conv.kernel),
      "k_conv": _float64(m.k_conv.kernel), "v_conv": _float64(m.v_conv.kernel),
      "dt_proj": _float64(m.dt_proj.kernel), "dt_bias": _float64(m.dt_bias),
      "A_log": _float64(m.A_log), "s_proj": _float64(m.s_proj.kernel),
      "beta_down": _float64(m.beta_down.kernel),
      "beta_up": _float64(m.beta_up.kernel),
      "beta_up_bias": _float64(m.beta_up.bias),
      "b_scale": _float64(m.b_scale), "Ip_log": _float64(m.Ip_log),
      "D": _float64(m.D), "gate_proj": _float64(m.gate_proj.kernel),
      "norm": _float64(m.out_norm.scale),
      "out_proj": _float64(m.out_proj.kernel)}
  x = jax.random.normal(jax.random.key(11), (BATCH, LENGTH, 64))
  config = _config("palimpsa_d")
  with jax.enable_x64(True):
    expected = _palimpsa_d_reference(
        params, np.asarray(x, np.float64), config.num_heads,
        config.head_k_dim, config.head_v_dim, config.norm_eps)
  return mixer, x, expected


def _meta_mamba2_case():
  """(MetaMamba2 mixer, x, its float64 reference output)."""
  mixer = _mixer("meta_mamba2")
  _perturb(mixer, 12, scale=0.2)
  _set_head_params(mixer, 13, b_scale_raw=3.0)
  m = mixer
  params = {"in_proj": _float64(m.in_proj.kernel),
            "conv_w": _float64(m.conv.kernel), "conv_b": _float64(m.conv.bias),
            "dt_bias": _float64(m.dt_bias), "A_log": _float64(m.A_log),
            "beta_down": _float64(m.beta_down.kernel),
            "beta_up": _float64(m.beta_up.kernel),
            "beta_up_bias": _float64(m.beta_up.bias),
            "b_scale": _float64(m.b_scale), "Ip_log": _float64(m.Ip_log),
            "D": _float64(m.D), "norm": _float64(m.norm.scale),
            "out_proj": _float64(m.out_proj.kernel)}
  x = jax.random.normal(jax.random.key(14), (BATCH, LENGTH, 64))
  config = _config("meta_mamba2")
  with jax.enable_x64(True):
    expected = _meta_mamba2_reference(
        params, np.asarray(x, np.float64), mixer.num_heads, config.head_dim,
        config.state_dim, config.num_groups, config.norm_eps)
  return mixer, x, expected


class TestMixersEqualFloat64References(chex.TestCase):
  """Mixers with a float64 numpy reference, jitted and run eagerly (op by op)."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("mamba2", "palimpsa_d", "meta_mamba2")
  def test_equals_reference(self, model):
    case = {"mamba2": _mamba2_case, "palimpsa_d": _palimpsa_d_case,
            "meta_mamba2": _meta_mamba2_case}[model]
    mixer, x, expected = case()
    assert_close_to_reference(self.variant(_apply)(mixer, x), expected, FLOAT32_TOL)

"""MetaMamba2 (Palimpsa-M): Mamba2 with metaplasticity; False is Mamba2."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers import params as params_lib
from palimpsa_jax.layers.checks import check_mixer_input
from palimpsa_jax.layers.conv import ShortConv
from palimpsa_jax.layers.diagnostics import gate_diagnostics, palimpsa_diagnostics
from palimpsa_jax.layers.linear import Dense
from palimpsa_jax.layers.norms import GatedRMSNorm
from palimpsa_jax.layers.recurrent import MetaplasticMixer, check_precision
from palimpsa_jax.ops import PalimpsaState
from palimpsa_jax.ops.fast_palimpsa import FastPalimpsaCache


class MetaMamba2Cache(NamedTuple):
  """Decode cache: xBC conv state [B, W-1, C] f32 and the memory: the posterior [B, H, P, N]
  (precision "exact") or Fast Palimpsa's decode cache ("rank1")."""

  conv: jax.Array
  state: PalimpsaState | FastPalimpsaCache


class MetaMamba2(MetaplasticMixer):
  """Mamba2 mixer on the Palimpsa op (docs/models.md, layers, Palimpsa-M).

  in_proj(x) = [z (d_inner), xBC (d_inner + 2 G N), dt (H)]; xBC goes through a
  causal depthwise conv (bias, SiLU) and splits into x [H heads of P], B, C
  [G groups of N, repeated to heads]. q = C, k = B, v = x * dt,
  log_alpha = -A * dt with dt = softplus(dt + dt_bias); with metaplasticity,
  beta = sigmoid(low-rank(x_in)) * softplus(b_scale) * dt. y = op + D * x,
  then RMSNorm(y * silu(z)) over norm_groups groups of the d_inner features
  (None: G, as mamba_ssm; the authors' PyTorch layer uses 1) and out_proj.
  metaplasticity=False is Mamba2 exactly (beta = 0, no beta parameters).
  beta_bias=False drops the bias of the low-rank up-projection (as in the
  authors' PyTorch layer).
  precision="rank1" runs Fast Palimpsa (docs/fast_palimpsa.md) with chunk_size as its chunk.
  """

  def __init__(
      self, d_model: int, *, expand: int, head_dim: int, state_dim: int,
      num_groups: int, beta_rank: int, rngs: nnx.Rngs,
      metaplasticity: bool = True, conv_kernel: int = 4,
      A_init: str = "arange", A_init_range: tuple[float, float] = (1.0, 16.0),
      dt_min: float = 1e-3, dt_max: float = 1e-1,
      dt_init_floor: float = 1e-4, norm_eps: float = 1e-5,
      init_std: float = params_lib.INIT_STD, implementation: str = "auto",
      chunk_size: int = 64, beta_bias: bool = True,
      norm_groups: int | None = None, precision: str = "exact", dtype=jnp.float32):
    check_precision(precision)
    d_inner = expand * d_model
    if d_inner % head_dim:
      raise ValueError(
          f"head_dim {head_dim} must divide d_inner = expand * d_model = "
          f"{d_inner}")
    h = d_inner // head_dim
    if h % num_groups:
      raise ValueError(
          f"num_groups {num_groups} must divide the number of heads {h}")
    norm_groups = num_groups if norm_groups is None else norm_groups
    if norm_groups < 1 or d_inner % norm_groups:
      raise ValueError(
          f"norm_groups {norm_groups} must be positive and divide d_inner {d_inner}")
    init = params_lib.normal_init(init_std)
    conv_dim = d_inner + 2 * num_groups * state_dim
    self.in_proj = Dense(d_model, 2 * d_inner + 2 * num_groups * state_dim + h,
                         names=("embed", None), rngs=rngs, kernel_init=init,
                         dtype=dtype)
    self.conv = ShortConv(conv_dim, conv_kernel, rngs=rngs, use_bias=True,
                          channel_name=None, dtype=dtype)
    self.A_log, self.dt_bias = params_lib.forget_gate_params(
        rngs, h, A_init, A_init_range, dt_min, dt_max, dt_init_floor)
    self.D = params_lib.make_param(jnp.ones((h,)), ("heads",))
    if metaplasticity:
      self.beta_down = Dense(d_model, beta_rank, names=("embed", "rank"),
                             rngs=rngs, kernel_init=init, dtype=dtype)
      self.beta_up = Dense(
          beta_rank, d_inner, names=("rank", "heads"), rngs=rngs,
          kernel_init=params_lib.fan_in_uniform_init(beta_rank),
          use_bias=beta_bias,
          bias_init=params_lib.fan_in_uniform_init(beta_rank), dtype=dtype)
      self.b_scale = params_lib.make_param(jnp.ones((h,)), ("heads",))
      self.Ip_log = params_lib.make_param(jnp.zeros((h,)), ("heads",))
    self.norm = GatedRMSNorm(d_inner, group_size=d_inner // norm_groups,
                             norm_before_gate=False, eps=norm_eps,
                             names=("heads",), dtype=dtype)
    self.out_proj = Dense(d_inner, d_model, names=("heads", "embed"),
                          rngs=rngs, kernel_init=init, dtype=dtype)
    self.d_inner, self.num_heads, self.head_dim = d_inner, h, head_dim
    self.state_dim, self.num_groups = state_dim, num_groups
    self.metaplasticity = metaplasticity
    self.d_model = d_model
    self.implementation = implementation
    self.chunk_size = chunk_size
    self.precision = precision
    self.dtype = dtype

  def init_cache(self, batch_size: int, max_length: int,
                 dtype=jnp.float32) -> MetaMamba2Cache:
    """Fixed-shape cache; independent of max_length (O(1) per token)."""
    del max_length, dtype
    return MetaMamba2Cache(self.conv.init_state(batch_size),
                           self._initial_memory(batch_size, self.head_dim, self.state_dim))

  def _op_inputs(self, xs, dt_raw, low_rank):
    """The op's value, beta and log decay from x [B, T, H, P] and the matmul outputs
    dt_raw [B, T, H] and low_rank [B, T, r] (None without metaplasticity).

    Returns v [B, T, H, P] and beta [B, T, H, P] (or None) in `dtype`, log_alpha
    [B, T, H] float32.
    """
    batch, length, h, p = xs.shape
    dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + self.dt_bias[...])
    log_alpha = -jnp.exp(self.A_log[...]) * dt  # [B, T, H]
    v = (xs.astype(jnp.float32) * dt[..., None]).astype(self.dtype)
    beta = None
    if low_rank is not None:
      gate = jax.nn.sigmoid(self.beta_up(low_rank).astype(jnp.float32))
      beta = (gate.reshape(batch, length, h, p)
              * jax.nn.softplus(self.b_scale[...])[:, None] * dt[..., None])
      beta = beta.astype(self.dtype)
    return v, beta, log_alpha

  def _output(self, readout, xs, z):
    """out_proj(norm((readout + D * x) * silu(z))) [B, T, d] from readout, x [B, T, H, P]
    and z [B, T, d_inner]."""
    batch, length = xs.shape[:2]
    out = readout.astype(jnp.float32) + self.D[...][:, None] * xs.astype(jnp.float32)
    return self.out_proj(self.norm(out.reshape(batch, length, self.d_inner), z))

  def _forward(self, x, cache, segment_ids, implementation,
               return_diagnostics):
    check_mixer_input(x, self.d_model)
    batch, length, _ = x.shape
    h, p, n, g = self.num_heads, self.head_dim, self.state_dim, self.num_groups
    d_inner = self.d_inner
    z, xbc, dt = jnp.split(self.in_proj(x),
                           [d_inner, 2 * d_inner + 2 * g * n], axis=-1)
    xbc, conv_state = self.conv(xbc, None if cache is None else cache.conv,
                                segment_ids)
    xs, b, c = jnp.split(xbc, [d_inner, d_inner + g * n], axis=-1)
    xs = xs.reshape(batch, length, h, p)
    b = jnp.repeat(b.reshape(batch, length, g, n), h // g, axis=2)
    c = jnp.repeat(c.reshape(batch, length, g, n), h // g, axis=2)

    low_rank = self.beta_down(x) if self.metaplasticity else None
    # The gates and the value written are elementwise in the matmul outputs and x: the
    # backward recomputes them rather than keep their float32 forms.
    v, beta, log_alpha = jax.checkpoint(self._op_inputs)(xs, dt, low_rank)
    result, memory = self._memory(
        c, b, v, beta, log_alpha, None if cache is None else cache.state, segment_ids,
        return_diagnostics, implementation)
    # The backward keeps the readout, x and z in the compute dtype and recomputes their
    # float32 sum and its norm (out_proj's forward matmul is not run again).
    y = jax.checkpoint(self._output)(result.out, xs, z)
    diagnostics = None
    if return_diagnostics:
      diagnostics = {
          **palimpsa_diagnostics(result, c, self.prior_precision(), y),
          **gate_diagnostics(log_alpha)}
    return y, MetaMamba2Cache(conv_state, memory), diagnostics

"""Palimpsa-D mixer (a drop-in for a Gated DeltaNet mixer) and NotPalimpsa."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers import params as params_lib
from palimpsa_jax.layers.checks import check_mixer_input
from palimpsa_jax.layers.diagnostics import gate_diagnostics, palimpsa_diagnostics
from palimpsa_jax.layers.linear import Dense
from palimpsa_jax.layers.norms import GatedRMSNorm
from palimpsa_jax.layers.qkv import ConvolvedQKV
from palimpsa_jax.layers.recurrent import MetaplasticMixer, check_precision
from palimpsa_jax.ops import PalimpsaState
from palimpsa_jax.ops.fast_palimpsa import FastPalimpsaCache


class PalimpsaDCache(NamedTuple):
  """Decode cache: conv states [B, W-1, C] f32 and the memory: the posterior [B, H, V, K]
  (precision "exact") or Fast Palimpsa's decode cache ("rank1")."""

  q_conv: jax.Array
  k_conv: jax.Array
  v_conv: jax.Array
  state: PalimpsaState | FastPalimpsaCache


class PalimpsaD(ConvolvedQKV, MetaplasticMixer):
  """Palimpsa-D (docs/models.md, layers); metaplasticity=False is NotPalimpsa.

  q, k, v: Linear + causal short conv + SiLU; q, k L2-normalised, q * K^-0.5.
  log_alpha = -A * softplus(dt_proj(x) + dt_bias); s = sigmoid(s_proj(x)) scales
  the written value and beta; beta = sigmoid(low-rank(x)) * softplus(b_scale) * s.
  out = palimpsa(...) + D * v, per-head gated RMSNorm (swish gate), out_proj.
  NotPalimpsa has no beta parameters and runs the op's SimpleGLA path.
  precision="rank1" runs Fast Palimpsa (docs/fast_palimpsa.md) with chunk_size as its chunk.
  beta_bias=False drops the bias of the low-rank up-projection (as in the
  authors' PyTorch layer).
  """

  def __init__(
      self, d_model: int, *, num_heads: int, head_k_dim: int, head_v_dim: int,
      beta_rank: int, rngs: nnx.Rngs, metaplasticity: bool = True,
      conv_kernel: int = 4, A_init: str = "uniform",
      A_init_range: tuple[float, float] = (0.0, 16.0), dt_min: float = 1e-3,
      dt_max: float = 1e-1, dt_init_floor: float = 1e-4,
      norm_eps: float = 1e-6, init_std: float = params_lib.INIT_STD,
      implementation: str = "auto", chunk_size: int = 64,
      beta_bias: bool = True, precision: str = "exact", dtype=jnp.float32):
    check_precision(precision)
    h, kd, vd = num_heads, head_k_dim, head_v_dim
    init = params_lib.normal_init(init_std)
    dense = lambda i, o, names: Dense(i, o, names=names, rngs=rngs,
                                      kernel_init=init, dtype=dtype)
    self._init_qkv(d_model, h, kd, vd, dense, conv_kernel, rngs, dtype)
    self.dt_proj = dense(d_model, h, ("embed", "heads"))
    self.s_proj = dense(d_model, h, ("embed", "heads"))
    self.A_log, self.dt_bias = params_lib.forget_gate_params(
        rngs, h, A_init, A_init_range, dt_min, dt_max, dt_init_floor)
    self.D = params_lib.make_param(jnp.ones((h,)), ("heads",))
    if metaplasticity:
      self.beta_down = dense(d_model, beta_rank, ("embed", "rank"))
      self.beta_up = Dense(
          beta_rank, h * vd, names=("rank", "heads"), rngs=rngs,
          kernel_init=params_lib.fan_in_uniform_init(beta_rank),
          use_bias=beta_bias,
          bias_init=params_lib.fan_in_uniform_init(beta_rank), dtype=dtype)
      self.b_scale = params_lib.make_param(jnp.ones((h,)), ("heads",))
      self.Ip_log = params_lib.make_param(jnp.zeros((h,)), ("heads",))
    self.gate_proj = dense(d_model, h * vd, ("embed", "heads"))
    self.out_norm = GatedRMSNorm(vd, eps=norm_eps, norm_before_gate=True,
                                 names=("kv",), dtype=dtype)
    self.out_proj = Dense(h * vd, d_model, names=("heads", "embed"),
                          rngs=rngs, kernel_init=init, dtype=dtype)
    self.num_heads, self.head_k_dim, self.head_v_dim = h, kd, vd
    self.metaplasticity = metaplasticity
    self.d_model = d_model
    self.implementation = implementation
    self.chunk_size = chunk_size
    self.precision = precision
    self.dtype = dtype

  def init_cache(self, batch_size: int, max_length: int,
                 dtype=jnp.float32) -> PalimpsaDCache:
    """Fixed-shape cache; independent of max_length (O(1) per token)."""
    del max_length, dtype
    return PalimpsaDCache(
        *self._initial_conv_states(batch_size),
        self._initial_memory(batch_size, self.head_v_dim, self.head_k_dim))

  def _op_inputs(self, v, dt_raw, s_raw, low_rank):
    """The op's value, beta and log decay from v [B, T, H, V] and the matmul outputs
    dt_raw, s_raw [B, T, H] and low_rank [B, T, r] (None without metaplasticity).

    Returns written [B, T, H, V] and beta [B, T, H, V] (or None) in `dtype`, log_alpha
    [B, T, H] float32.
    """
    batch, length, h, vd = v.shape
    dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + self.dt_bias[...])
    log_alpha = -jnp.exp(self.A_log[...]) * dt  # [B, T, H]
    s = jax.nn.sigmoid(s_raw.astype(jnp.float32))[..., None]
    written = (v.astype(jnp.float32) * s).astype(self.dtype)
    beta = None
    if low_rank is not None:
      gate = jax.nn.sigmoid(self.beta_up(low_rank).astype(jnp.float32))
      beta = (gate.reshape(batch, length, h, vd)
              * jax.nn.softplus(self.b_scale[...])[:, None] * s)
      beta = beta.astype(self.dtype)
    return written, beta, log_alpha

  def _output(self, readout, v, gate):
    """out_proj(gated norm(readout + D * v)) [B, T, d] from readout, v [B, T, H, V] and
    gate [B, T, H * V]."""
    batch, length, h, vd = v.shape
    out = readout.astype(jnp.float32) + self.D[...][:, None] * v.astype(jnp.float32)
    normed = self.out_norm(out, gate.reshape(batch, length, h, vd))
    return self.out_proj(normed.reshape(batch, length, h * vd))

  def _forward(self, x, cache, segment_ids, implementation,
               return_diagnostics):
    check_mixer_input(x, self.d_model)
    batch, length, _ = x.shape
    h, vd = self.num_heads, self.head_v_dim
    q, k, v, conv_states = self._qkv(x, cache, segment_ids)
    low_rank = self.beta_down(x) if self.metaplasticity else None
    # The gates and the value written are elementwise in the small matmul outputs and v:
    # the backward recomputes them rather than keep their float32 forms.
    written, beta, log_alpha = jax.checkpoint(self._op_inputs)(
        v, self.dt_proj(x), self.s_proj(x), low_rank)
    result, memory = self._memory(
        q.astype(self.dtype), k.astype(self.dtype), written, beta, log_alpha,
        None if cache is None else cache.state, segment_ids, return_diagnostics,
        implementation)
    # The backward keeps the readout, v and the gate in the compute dtype and recomputes
    # their float32 sum and its norm (out_proj's forward matmul is not run again).
    y = jax.checkpoint(self._output)(result.out, v, self.gate_proj(x))
    new_cache = PalimpsaDCache(*conv_states, memory)
    diagnostics = None
    if return_diagnostics:
      diagnostics = {
          **palimpsa_diagnostics(result, q, self.prior_precision(), y),
          **gate_diagnostics(log_alpha)}
    return y, new_cache, diagnostics

"""Gated DeltaNet mixer on the gated delta rule op."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers import params as params_lib
from palimpsa_jax.layers.checks import check_mixer_input
from palimpsa_jax.layers.diagnostics import gate_diagnostics, rms
from palimpsa_jax.layers.linear import Dense
from palimpsa_jax.layers.norms import GatedRMSNorm, projected_gated_norm
from palimpsa_jax.layers.qkv import ConvolvedQKV
from palimpsa_jax.layers.readout import named_readout
from palimpsa_jax.layers.recurrent import RecurrentMixer
from palimpsa_jax.ops import gated_delta_rule


class GatedDeltaNetCache(NamedTuple):
  """Decode cache: conv states [B, W-1, C] f32 and S [B, H, V, K] f32."""

  q_conv: jax.Array
  k_conv: jax.Array
  v_conv: jax.Array
  state: jax.Array


class GatedDeltaNet(ConvolvedQKV, RecurrentMixer):
  """Standard Gated DeltaNet mixer.

  q, k, v: Linear + causal short conv + SiLU; q, k L2-normalised, q * K^-0.5;
  beta = sigmoid(b_proj(x)) per head; log_alpha = -A * softplus(a_proj(x) +
  dt_bias); per-head gated RMSNorm (swish gate g_proj(x)); out_proj.
  """

  def __init__(
      self, d_model: int, *, num_heads: int, head_k_dim: int, head_v_dim: int,
      rngs: nnx.Rngs, conv_kernel: int = 4, A_init: str = "uniform",
      A_init_range: tuple[float, float] = (0.0, 16.0), dt_min: float = 1e-3,
      dt_max: float = 1e-1, dt_init_floor: float = 1e-4,
      norm_eps: float = 1e-6, init_std: float = params_lib.INIT_STD,
      implementation: str = "auto", chunk_size: int = 64,
      dtype=jnp.float32):
    h, kd, vd = num_heads, head_k_dim, head_v_dim
    init = params_lib.normal_init(init_std)
    dense = lambda i, o, names: Dense(i, o, names=names, rngs=rngs,
                                      kernel_init=init, dtype=dtype)
    self._init_qkv(d_model, h, kd, vd, dense, conv_kernel, rngs, dtype)
    self.a_proj = dense(d_model, h, ("embed", "heads"))
    self.b_proj = dense(d_model, h, ("embed", "heads"))
    self.A_log, self.dt_bias = params_lib.forget_gate_params(
        rngs, h, A_init, A_init_range, dt_min, dt_max, dt_init_floor)
    self.gate_proj = dense(d_model, h * vd, ("embed", "heads"))
    self.out_norm = GatedRMSNorm(vd, eps=norm_eps, norm_before_gate=True,
                                 names=("kv",), dtype=dtype)
    self.out_proj = Dense(h * vd, d_model, names=("heads", "embed"),
                          rngs=rngs, kernel_init=init, dtype=dtype)
    self.num_heads, self.head_k_dim, self.head_v_dim = h, kd, vd
    self.d_model = d_model
    self.implementation = implementation
    self.chunk_size = chunk_size
    self.dtype = dtype

  def init_cache(self, batch_size: int, max_length: int,
                 dtype=jnp.float32) -> GatedDeltaNetCache:
    """Fixed-shape cache; independent of max_length (O(1) per token)."""
    del max_length, dtype
    shape = (batch_size, self.num_heads, self.head_v_dim, self.head_k_dim)
    return GatedDeltaNetCache(*self._initial_conv_states(batch_size),
                              jnp.zeros(shape, jnp.float32))

  def _gates(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, T, d_model] -> (beta in (0, 1), log decay <= 0), each [B, T, H] float32."""
    beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
    dt = jax.nn.softplus(self.a_proj(x).astype(jnp.float32)
                         + self.dt_bias[...])
    return beta, -jnp.exp(self.A_log[...]) * dt

  def _forward(self, x, cache, segment_ids, implementation,
               return_diagnostics):
    check_mixer_input(x, self.d_model)
    batch, length, _ = x.shape
    h, vd = self.num_heads, self.head_v_dim
    q, k, v, conv_states = self._qkv(x, cache, segment_ids)
    q = q.astype(self.dtype)
    beta, log_alpha = self._gates(x)

    result = gated_delta_rule(
        q, k, v, beta.astype(self.dtype), log_alpha,
        initial_state=None if cache is None else cache.state,
        segment_ids=segment_ids, implementation=implementation,
        chunk_size=self.chunk_size)
    g = self.gate_proj(x).reshape(batch, length, h, vd)
    y = projected_gated_norm(self.out_norm, self.out_proj, named_readout(result.out), g)
    diagnostics = None
    if return_diagnostics:
      diagnostics = {"state_rms": rms(result.state), "output_rms": rms(y),
                     **gate_diagnostics(log_alpha)}
    return y, GatedDeltaNetCache(*conv_states, result.state), diagnostics

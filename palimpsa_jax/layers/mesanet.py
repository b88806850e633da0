"""MesaNet mixer: the Gated DeltaNet layout with the MesaNet (ridge-regression) readout."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from palimpsa_jax.layers import params as params_lib
from palimpsa_jax.layers.checks import check_mixer_input
from palimpsa_jax.layers.diagnostics import gate_diagnostics, rms
from palimpsa_jax.layers.gated_deltanet import GatedDeltaNet
from palimpsa_jax.layers.norms import projected_gated_norm
from palimpsa_jax.layers.readout import named_readout
from palimpsa_jax.ops import MesaState, mesa_net

# lam = softplus(lam_raw) + LAM_FLOOR, starting at 1 (the published MesaNet values).
LAM_FLOOR, LAM_INIT = 0.25, 1.0


class MesaNetCache(NamedTuple):
  """Decode cache: conv states [B, W-1, C] f32 and the sums (H [B, H, K, K], G [B, H, V, K])."""

  q_conv: jax.Array
  k_conv: jax.Array
  v_conv: jax.Array
  state: MesaState


class MesaNet(GatedDeltaNet):
  """MesaNet mixer (docs/mesanet.md): Gated DeltaNet's layers with the MesaNet readout.

  q, k, v: Linear + causal short conv + SiLU; q, k L2-normalised, q * K^-0.5;
  beta = sigmoid(b_proj(x)) per head; log_gamma = -A * softplus(a_proj(x) + dt_bias)
  (Gated DeltaNet's forget gate); lam = softplus(lam_raw) + 0.25 per head and key channel;
  out = mesa_net(...) with cg_steps conjugate-gradient steps over whole sequences (an exact
  solve per decoded token); per-head gated RMSNorm (swish gate g_proj(x)); out_proj.
  Constructor arguments: cg_steps and those of GatedDeltaNet.
  """

  def __init__(self, d_model: int, *, cg_steps: int = 30, **kwargs):
    super().__init__(d_model, **kwargs)
    raw = math.log(math.expm1(LAM_INIT - LAM_FLOOR))
    self.lam_raw = params_lib.make_param(
        jnp.full((self.num_heads, self.head_k_dim), raw), ("heads", "kv"))
    self.cg_steps = cg_steps

  def regulariser(self) -> jax.Array:
    """lam [H, K] f32, > 0.25."""
    return jax.nn.softplus(self.lam_raw[...]) + LAM_FLOOR

  def init_cache(self, batch_size: int, max_length: int,
                 dtype=jnp.float32) -> MesaNetCache:
    """Fixed-shape cache; independent of max_length (O(1) per token)."""
    del max_length, dtype
    h, kd, vd = self.num_heads, self.head_k_dim, self.head_v_dim
    state = MesaState(jnp.zeros((batch_size, h, kd, kd), jnp.float32),
                      jnp.zeros((batch_size, h, vd, kd), jnp.float32))
    return MesaNetCache(*self._initial_conv_states(batch_size), state)

  def _forward(self, x, cache, segment_ids, implementation,
               return_diagnostics):
    check_mixer_input(x, self.d_model)
    batch, length, _ = x.shape
    h, vd = self.num_heads, self.head_v_dim
    q, k, v, conv_states = self._qkv(x, cache, segment_ids)
    beta, log_gamma = self._gates(x)

    result = mesa_net(
        q, k, v, beta, log_gamma, self.regulariser(),
        initial_state=None if cache is None else cache.state,
        segment_ids=segment_ids, implementation=implementation,
        chunk_size=self.chunk_size, cg_steps=self.cg_steps)
    g = self.gate_proj(x).reshape(batch, length, h, vd)
    y = projected_gated_norm(self.out_norm, self.out_proj, named_readout(result.out), g)
    diagnostics = None
    if return_diagnostics:
      diagnostics = {"state_rms": rms(result.state.kv), "output_rms": rms(y),
                     "lam_mean": jnp.mean(self.regulariser()),
                     **gate_diagnostics(log_gamma)}
    return y, MesaNetCache(*conv_states, result.state), diagnostics

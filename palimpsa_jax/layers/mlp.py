"""SwiGLU feed-forward block."""

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers import params as params_lib
from palimpsa_jax.layers.linear import Dense


def swiglu_hidden_dim(d_model: int, hidden_ratio: float = 4.0,
                      multiple_of: int = 256) -> int:
  """int(2/3 * ratio * d) rounded up to `multiple_of` (Llama / FLA rule)."""
  hidden = int(d_model * hidden_ratio * 2 / 3)
  return multiple_of * -(-hidden // multiple_of)


class SwiGLU(nnx.Module):
  """down(silu(gate(x)) * up(x)), no biases; kernels ~ N(0, init_std^2)."""

  def __init__(self, d_model: int, hidden_dim: int, *, rngs: nnx.Rngs,
               init_std: float = params_lib.INIT_STD, dtype=jnp.float32):
    init = params_lib.normal_init(init_std)
    self.gate_proj = Dense(d_model, hidden_dim, names=("embed", "mlp"),
                           rngs=rngs, kernel_init=init, dtype=dtype)
    self.up_proj = Dense(d_model, hidden_dim, names=("embed", "mlp"),
                         rngs=rngs, kernel_init=init, dtype=dtype)
    self.down_proj = Dense(hidden_dim, d_model, names=("mlp", "embed"),
                           rngs=rngs, kernel_init=init, dtype=dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [B, T, d] -> [B, T, d] in the compute dtype."""
    return self.output(*self.project(x))

  def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The hidden projections (gate, up) [B, T, hidden] of x [B, T, d]."""
    return self.gate_proj(x), self.up_proj(x)

  def output(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    """down(silu(gate) * up) [B, T, d] from the hidden projections."""
    # The backward keeps the two matmul outputs and recomputes silu(gate) * up from them
    # (down_proj's weight gradient needs it; its forward matmul is not run again).
    down = jax.checkpoint(lambda gate, up: self.down_proj(jax.nn.silu(gate) * up))
    return down(gate, up)

"""The q, k, v front shared by Palimpsa-D and Gated DeltaNet.

Each of q, k, v is a Linear projection followed by a causal short conv + SiLU;
q and k are L2-normalised per head and q is scaled by K^-1/2.
"""

from collections.abc import Callable
from typing import Any

import jax

from palimpsa_jax.layers.conv import ShortConv
from palimpsa_jax.layers.norms import l2_normalize


class ConvolvedQKV:
  """Mixin for a mixer with num_heads heads of head_k_dim keys and head_v_dim values.

  The mixer calls _init_qkv in its __init__ and sets self.num_heads,
  self.head_k_dim and self.head_v_dim; its cache starts with the q, k and v
  conv states.
  """

  def _init_qkv(self, d_model: int, num_heads: int, head_k_dim: int,
                head_v_dim: int, dense: Callable[..., Any], conv_kernel: int,
                rngs: Any, dtype) -> None:
    """q_proj, k_proj, v_proj (dense(d_model, width, names)), then their convs."""
    qk_width, v_width = num_heads * head_k_dim, num_heads * head_v_dim
    self.q_proj = dense(d_model, qk_width, ("embed", "heads"))
    self.k_proj = dense(d_model, qk_width, ("embed", "heads"))
    self.v_proj = dense(d_model, v_width, ("embed", "heads"))
    conv = lambda width: ShortConv(width, conv_kernel, rngs=rngs, dtype=dtype)
    self.q_conv, self.k_conv, self.v_conv = (conv(qk_width), conv(qk_width),
                                             conv(v_width))

  def _initial_conv_states(self, batch_size: int) -> tuple[jax.Array, ...]:
    """The q, k and v conv states of an empty cache."""
    return tuple(c.init_state(batch_size)
                 for c in (self.q_conv, self.k_conv, self.v_conv))

  def _qkv(self, x: jax.Array, cache: Any, segment_ids: jax.Array | None):
    """x [B, T, d] from the cache's conv states (None: from zeros).

    Returns:
      q, k [B, T, H, K] (normalised, q scaled) and v [B, T, H, V], in the
      convs' output dtype, and the new (q, k, v) conv states.
    """
    batch, length, _ = x.shape
    h, kd, vd = self.num_heads, self.head_k_dim, self.head_v_dim
    conv_states = (None,) * 3 if cache is None else cache[:3]

    def convolve_and_normalize(conv, projected, state, scale):
      y, new_state = conv(projected, state, segment_ids)
      y = l2_normalize(y.reshape(batch, length, h, kd))
      return (y if scale is None else y * scale), new_state

    # From the projection to the normalised q or k in one checkpoint: the backward keeps
    # the projection's output alone and recomputes the convolution's output from it.
    normalized = jax.checkpoint(convolve_and_normalize, static_argnums=(0, 3))
    q, q_conv = normalized(self.q_conv, self.q_proj(x), conv_states[0], kd ** -0.5)
    k, k_conv = normalized(self.k_conv, self.k_proj(x), conv_states[1], None)
    v, v_conv = self.v_conv(self.v_proj(x), conv_states[2], segment_ids)
    return q, k, v.reshape(batch, length, h, vd), (q_conv, k_conv, v_conv)

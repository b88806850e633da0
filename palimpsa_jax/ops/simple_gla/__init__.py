"""Scalar-gated linear attention (SimpleGLA; the Mamba2 / SSD recurrence).

Per batch element and head, with a_t = exp(log_alpha_t):

    h_t   = a_t * h_{t-1} + v_t k_t^T          (h: [V, K])
    out_t = h_t q_t

This is Palimpsa with beta = 0 and prior precision 1 (docs/math.md, special cases); `palimpsa(beta=None)`
divides by the prior precision itself. Shapes: q, k [B, T, H, K]; v [B, T, H, V];
log_alpha [B, T, H]; state [B, H, V, K] float32. All arithmetic runs in float32.
"""

from palimpsa_jax.ops.simple_gla.api import simple_gla
from palimpsa_jax.ops.simple_gla.types import SimpleGLAResult

__all__ = ["SimpleGLAResult", "simple_gla"]

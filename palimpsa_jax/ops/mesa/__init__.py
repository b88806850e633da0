"""MesaNet: per-step regularised least squares of values on keys (von Oswald et al., 2025)."""

from palimpsa_jax.ops.mesa.op import MesaResult, MesaState, mesa_net

__all__ = ["MesaResult", "MesaState", "mesa_net"]

"""MesaNet: per-step regularised least squares of values on keys (von Oswald et al., 2025)."""

from palimpsa_jax.ops.mesa_net.api import mesa_net
from palimpsa_jax.ops.mesa_net.types import MesaNetResult, MesaState

__all__ = ["MesaNetResult", "MesaState", "mesa_net"]

"""Recurrence ops: Palimpsa, its SimpleGLA special case, the gated delta rule and MesaNet."""

from palimpsa_jax.ops.gated_delta import DeltaRuleResult, gated_delta_rule
from palimpsa_jax.ops.gla import GLAResult, simple_gla
from palimpsa_jax.ops.mesa import MesaResult, MesaState, mesa_net
from palimpsa_jax.ops.palimpsa import PalimpsaResult, PalimpsaState, palimpsa

__all__ = [
    "DeltaRuleResult",
    "GLAResult",
    "MesaResult",
    "MesaState",
    "PalimpsaResult",
    "PalimpsaState",
    "gated_delta_rule",
    "mesa_net",
    "palimpsa",
    "simple_gla",
]

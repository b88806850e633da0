"""Recurrence ops: Palimpsa, its SimpleGLA special case and the gated delta rule."""

from palimpsa_jax.ops.gated_delta import DeltaRuleResult, gated_delta_rule
from palimpsa_jax.ops.gla import GLAResult, simple_gla
from palimpsa_jax.ops.palimpsa import PalimpsaResult, PalimpsaState, palimpsa

__all__ = [
    "DeltaRuleResult",
    "GLAResult",
    "PalimpsaResult",
    "PalimpsaState",
    "gated_delta_rule",
    "palimpsa",
    "simple_gla",
]

"""Recurrence ops: Palimpsa, its SimpleGLA special case, its rank-1 approximation (Fast
Palimpsa), the gated delta rule and MesaNet; and the token loss of a tied output head."""

from palimpsa_jax.ops.fast_palimpsa import fast_palimpsa
from palimpsa_jax.ops.gated_delta_rule import GatedDeltaRuleResult, gated_delta_rule
from palimpsa_jax.ops.simple_gla import SimpleGLAResult, simple_gla
from palimpsa_jax.ops.mesa_net import MesaNetResult, MesaState, mesa_net
from palimpsa_jax.ops.palimpsa import PalimpsaResult, PalimpsaState, palimpsa
from palimpsa_jax.ops.token_loss import TokenLoss, logits_token_loss, token_loss

__all__ = [
    "GatedDeltaRuleResult",
    "MesaNetResult",
    "MesaState",
    "PalimpsaResult",
    "PalimpsaState",
    "SimpleGLAResult",
    "TokenLoss",
    "fast_palimpsa",
    "gated_delta_rule",
    "logits_token_loss",
    "mesa_net",
    "palimpsa",
    "simple_gla",
    "token_loss",
]

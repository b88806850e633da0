"""Gated delta rule (Gated DeltaNet; DeltaNet when log_alpha = 0)."""

from palimpsa_jax.ops.gated_delta_rule.api import gated_delta_rule
from palimpsa_jax.ops.gated_delta_rule.types import GatedDeltaRuleResult

__all__ = ["GatedDeltaRuleResult", "gated_delta_rule"]

"""Gated delta rule (Gated DeltaNet; DeltaNet when log_alpha = 0)."""

from palimpsa_jax.ops.gated_delta.op import DeltaRuleResult, gated_delta_rule

__all__ = ["DeltaRuleResult", "gated_delta_rule"]

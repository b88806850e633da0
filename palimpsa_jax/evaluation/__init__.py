"""Evaluation suites (MQAR, perplexity, long context, commonsense); see suites.py."""

from palimpsa_jax.evaluation.suites import SUITES

__all__ = ["SUITES"]

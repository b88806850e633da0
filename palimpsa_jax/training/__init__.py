"""Training: optimizer, sharding, train state, steps, checkpoints, metrics, loop."""

from palimpsa_jax.training.checkpoint import load_model
from palimpsa_jax.training.trainer import NonFiniteError, train_and_evaluate

__all__ = ["NonFiniteError", "load_model", "train_and_evaluate"]

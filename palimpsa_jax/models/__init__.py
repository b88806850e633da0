"""Language models, their configs, decoding and parameter summaries."""

from palimpsa_jax.models.config import model_config, mqar_model_config
from palimpsa_jax.models.decoding import generate
from palimpsa_jax.models.language_model import (Block, LanguageModel,
                                                build_model, make_mixer,
                                                metaplastic_layers,
                                                take_positions)
from palimpsa_jax.models.paths import path_names
from palimpsa_jax.models.summary import (abstract_parameter_count,
                                         count_parameters, parameter_table)
from palimpsa_jax.models.weight_decay import weight_decay_mask

__all__ = [
    "Block",
    "LanguageModel",
    "abstract_parameter_count",
    "build_model",
    "count_parameters",
    "generate",
    "make_mixer",
    "metaplastic_layers",
    "model_config",
    "mqar_model_config",
    "parameter_table",
    "path_names",
    "take_positions",
    "weight_decay_mask",
]

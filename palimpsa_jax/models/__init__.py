"""Language models, their configs, decoding and parameter summaries."""

from palimpsa_jax.models.config import model_config, mqar_model_config
from palimpsa_jax.models.decoding import generate
from palimpsa_jax.models.language_model import (TRAIN_STEP_COMPILER_OPTIONS, Block,
                                                LanguageModel, build_model,
                                                metaplastic_layers, take_positions)
from palimpsa_jax.models.new_parameters import (NEW_PARAMETER_NAMES, is_new_parameter,
                                                new_parameter_mask)
from palimpsa_jax.models.parts import (ModelFn, ModelParts, abstract_model,
                                       abstract_on_first_local_device, merge_model,
                                       split_model)
from palimpsa_jax.models.paths import path_names
from palimpsa_jax.models.registry import make_mixer
from palimpsa_jax.models.summary import (abstract_parameter_count,
                                         count_parameters, parameter_table)
from palimpsa_jax.models.weight_decay import weight_decay_mask

__all__ = [
    "TRAIN_STEP_COMPILER_OPTIONS",
    "Block",
    "LanguageModel",
    "ModelFn",
    "ModelParts",
    "NEW_PARAMETER_NAMES",
    "abstract_model",
    "abstract_on_first_local_device",
    "abstract_parameter_count",
    "build_model",
    "count_parameters",
    "generate",
    "is_new_parameter",
    "make_mixer",
    "merge_model",
    "metaplastic_layers",
    "model_config",
    "mqar_model_config",
    "new_parameter_mask",
    "parameter_table",
    "path_names",
    "split_model",
    "take_positions",
    "weight_decay_mask",
]

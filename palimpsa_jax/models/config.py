"""Model configs: the schema of config.model, paper sizes and MQAR settings (docs/models.md).

A model config is a flat ml_collections.ConfigDict: the fields of FIELDS (every model) and
those of its kind (models/registry.py, KINDS[config.mixer].fields). `validate` checks it
field by field when a model is built; `upgrade` reads a model config saved by an earlier
version in today's form. A setting that may be "not set" is None, never a 0 that means
something else: mlp_hidden_dim None has no MLP, meta_mamba2's norm_groups None is num_groups.

metaplastic_layers: indices of layers whose mixer is metaplastic in addition to what
config.metaplasticity says for every layer (a converted Mamba2 / NotPalimpsa model,
docs/models.md, conversion); () (the default): none beyond it. Only for metaplastic kinds.
"""

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import ml_collections
from ml_collections import config_dict

from palimpsa_jax.layers.mlp import swiglu_hidden_dim
from palimpsa_jax.models import registry
from palimpsa_jax.run_config import base
from palimpsa_jax.run_config.values import REQUIRED, Field, flag, one_of, positive

MODELS = tuple(registry.MIXERS)
SIZES = ("tiny", "170m", "760m", "2.7b")
# config.matmul_precision -> the dot algorithm of the model's matmuls that name none
# (jax.default_matmul_precision); "default" leaves XLA's choice, which on recent
# NVIDIA GPUs runs float32 matmuls as TF32 (docs/gpu_performance.md).
MATMUL_PRECISIONS = {"default": None, "float32": "F32_F32_F32",
                     "tensorfloat32": "TF32_TF32_F32", "bfloat16": "BF16_BF16_F32"}
# Nominal parameter count of each size name (tiny has none).
NOMINAL_PARAMS = {"170m": 170e6, "760m": 760e6, "2.7b": 2.7e9}


def _name(default: str, what: str) -> Field:
  return Field(default, (str,), bool, what)


def _floating_dtype_name(name: str) -> bool:
  try:
    return jnp.issubdtype(jnp.dtype(name), jnp.floating)
  except TypeError:
    return False


# The fields of every model config; the kind's own follow from registry.KINDS.
FIELDS = {
    "model": one_of(REQUIRED, tuple(registry.MIXERS)),
    "mixer": one_of(REQUIRED, tuple(registry.KINDS)),
    "size": _name(REQUIRED, f"a size name ({', '.join(SIZES)}, 'mqar')"),
    "metaplasticity": flag(False),
    "metaplastic_layers": Field((), (tuple, list), lambda v: all(isinstance(i, int) for i in v),
                                "a sequence of layer indices"),
    "vocab_size": positive(),
    "d_model": positive(),
    "num_layers": positive(),
    "mlp_hidden_dim": Field(None, (int, type(None)), lambda v: v is None or v > 0,
                            "a positive int, or None (no MLP)"),
    "norm_eps": positive(1e-6, float),
    "init_std": positive(0.02, float),
    "dtype": Field("bfloat16", (str,), _floating_dtype_name,
                   "a floating dtype name (the compute dtype: bfloat16, float32, float16)"),
    "residual_in_fp32": flag(True),
    "remat": flag(False),
    # What a rematerialised block keeps (language_model.REMAT_SAVES).
    "remat_saves": _name("nothing", "a language_model.REMAT_SAVES name"),
    # One stacked, scanned block (see LanguageModel).
    "scan_layers": flag(False),
    "implementation": _name("auto", "an op implementation name or 'auto'"),
    "chunk_size": positive(64),
    "matmul_precision": one_of("default", tuple(MATMUL_PRECISIONS)),
    # "exact": the Palimpsa op; "rank1": Fast Palimpsa inside chunks of chunk_size
    # (docs/fast_palimpsa.md); metaplastic kinds only.
    "precision": one_of("exact", ("exact", "rank1")),
}

# Fields an earlier version did not write, with what their absence meant there where that
# is not today's default (a meta_mamba2 / palimpsa_d config without beta_bias had the bias).
_EARLIER_ABSENT = {"beta_bias": True}
# Fields where an earlier version wrote 0 for today's None.
_EARLIER_ZEROS = ("mlp_hidden_dim", "norm_groups")


def schema(mixer: str) -> dict[str, Field]:
  """Every field of a model config of kind `mixer` (registry.KINDS)."""
  return {**FIELDS, **registry.KINDS[mixer].fields}


def _config_dict(fields: dict[str, Any]) -> ml_collections.ConfigDict:
  """The fields as a ConfigDict; a None of a typed field stays settable from the command
  line (--config.model.<name>=5)."""
  fields = dict(fields)
  for name, field in schema(fields["mixer"]).items():
    if fields.get(name, 0) is None:
      kind = next(t for t in field.types if t is not type(None))
      fields[name] = config_dict.placeholder(kind)
  return ml_collections.ConfigDict(fields)


def _defaults(model: str) -> dict[str, Any]:
  """The fields of `model` with a default: the common ones and its kind's."""
  mixer = registry.mixer(model)
  kind = registry.KINDS[mixer.kind]
  fields = {name: field.default for name, field in schema(mixer.kind).items()
            if field.default is not REQUIRED}
  fields.update(model=model, mixer=mixer.kind, metaplasticity=mixer.metaplasticity,
                norm_eps=kind.norm_eps)
  return fields


def _apply_overrides(config: ml_collections.ConfigDict,
                     overrides: dict) -> ml_collections.ConfigDict:
  for key, value in overrides.items():
    if key not in config:
      raise ValueError(
          f"unknown model config field {key!r}; fields: {sorted(config)}")
    config[key] = value
  return config


def model_config(model: str, size: str, **overrides) -> ml_collections.ConfigDict:
  """Config of `model` at `size` (docs/models.md, sizes and recipe), with field overrides."""
  fields = _defaults(model)
  if size not in SIZES:
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")
  kind = registry.KINDS[fields["mixer"]]
  fields.update(kind.sizes[size], size=size)
  if kind.mlp and "mlp_hidden_dim" not in kind.sizes[size]:
    fields["mlp_hidden_dim"] = swiglu_hidden_dim(fields["d_model"])
  return _apply_overrides(_config_dict(fields), overrides)


def mqar_model_config(model: str, d_model: int = 128, vocab_size: int = 8192,
                      **overrides) -> ml_collections.ConfigDict:
  """MQAR model (docs/models.md, MQAR): 2 layers, no MLP, no positional embeddings.

  model is a registered mixer name (registry.MIXERS); its kind's MQAR layout
  (registry.KINDS[...].mqar) sets the mixer's fields. Forget gates start "small": A spread
  evenly over [0.01, 0.16] across heads, dt log-uniform over [1e-3, 1e-1].
  """
  fields = _defaults(model)
  kind = registry.KINDS[fields["mixer"]]
  fields.update(vocab_size=vocab_size, d_model=d_model, num_layers=2,
                mlp_hidden_dim=None, size="mqar", **kind.mqar(d_model))
  return _apply_overrides(_config_dict(fields), overrides)


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises base.ConfigError naming the first field of the model config that is missing,
  unknown or bad (the kind's own fields: registry.KINDS)."""
  if config.get("mixer") not in registry.KINDS:
    raise base.ConfigError(f"config.model.mixer must be one of {tuple(registry.KINDS)}, "
                           f"got {config.get('mixer')!r}.")
  base.check_group(config, schema(config.mixer), "config.model.")


def upgrade(saved: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A model config saved by an earlier version (config.json, conversion.json) in today's
  form: fields it did not write get what their absence meant, fields since removed are
  dropped, and its 0 for a setting that is not set (_EARLIER_ZEROS) reads as None. An
  unknown kind is left to `validate`."""
  fields = dict(saved.to_dict() if isinstance(saved, ml_collections.ConfigDict) else saved)
  if fields.get("mixer") not in registry.KINDS:
    return ml_collections.ConfigDict(fields)
  today = schema(fields["mixer"])
  fields = {name: value for name, value in fields.items() if name in today}
  for name, field in today.items():
    if name not in fields and name in _EARLIER_ABSENT:
      fields[name] = _EARLIER_ABSENT[name]
    elif name not in fields and field.default is not REQUIRED:
      fields[name] = field.default
  for name in _EARLIER_ZEROS:
    if fields.get(name) == 0:
      fields[name] = None
  return _config_dict(fields)

"""The run config: every field the trainer reads, with its default, type and check, once.

configs/mqar.py, configs/lm.py and configs/finetune.py start from `base_config(task)` and set
only what differs. A field whose default is REQUIRED has none: the config file sets it (from
its arguments). `validate` checks a config field by field, once, when a run starts
(training/trainer.py's validate_config) and raises ConfigError naming the first bad field and
what it expects. The checks that need the devices (mesh, batch shards) stay in the trainer.

A setting that may be "not set" is None there (total_steps: num_epochs passes; grad_accum_steps:
auto; device_batch, decay_steps, clip_norm, early_stop_accuracy: none), never a 0 that means
something else; `from_saved` reads the zeros that earlier versions wrote for these as None.

The groups config.model (its schema is models/config.py's, checked by the model builder),
config.args and config.finetune (the config file's own arguments, already checked when parsed)
are not described here.
"""

from collections.abc import Callable
import dataclasses
from typing import Any

import ml_collections

from palimpsa_jax import user_errors
from palimpsa_jax.run_config import config_args

TASKS = ("mqar", "lm")
class ConfigError(ValueError, user_errors.UserError):
  """A run config the trainer refuses; the message names the field and what it expects."""


REQUIRED = object()  # A default that means "the config file sets this field".
# Groups of fields the trainer does not read (see the module docstring).
FREE_GROUPS = ("model", "args", "finetune")


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field.

  Attributes:
    default: its value in base_config, or REQUIRED.
    types: the accepted value types (bool is never an int or a float here).
    check: value -> whether it is allowed (after the type check).
    expected: what an allowed value is, for the error ("a positive int").
  """
  default: Any
  types: tuple[type, ...]
  check: Callable[[Any], bool]
  expected: str


def _any(_: Any) -> bool:
  return True


def positive(default: Any = REQUIRED, kind: type = int) -> Field:
  """A positive `kind` (also the model config's fields, models/config.py)."""
  return Field(default, (kind,), lambda v: v > 0, f"a positive {kind.__name__}")


def flag(default: bool) -> Field:
  return Field(default, (bool,), _any, "True or False")


def one_of(default: Any, choices: tuple[Any, ...]) -> Field:
  """One of `choices` (strings, or None too)."""
  return Field(default, tuple(dict.fromkeys(type(c) for c in choices)), lambda v: v in choices,
               f"one of {choices}")


def _positive_int(default: Any) -> Field:
  return positive(default)


def _fraction(default: Any) -> Field:
  return Field(default, (float,), lambda v: 0 <= v <= 1, "a number in [0, 1]")


def _positive_or_none(default: Any, kind: type, none: str) -> Field:
  """A positive `kind`, or None meaning `none`."""
  return Field(default, (kind, type(None)), lambda v: v is None or v > 0,
               f"a positive {kind.__name__}, or None ({none})")


def _mesh_axis(default: int) -> Field:
  return Field(default, (int,), lambda v: v == -1 or v > 0,
               "a positive int, or -1 for the remaining devices")


# The top-level fields; "data" holds DATA_FIELDS[task].
FIELDS = {
    "task": Field(REQUIRED, (str,), lambda v: v in TASKS, f"one of {TASKS}"),
    "seed": Field(REQUIRED, (int,), _any, "an int"),
    "seq_len": _positive_int(REQUIRED),
    "batch_size": _positive_int(REQUIRED),  # Global, in sequences.
    "eval_batch_size": _positive_int(REQUIRED),  # Global, in sequences.
    # None: as many microbatches as keep each device at device_batch sequences or fewer.
    "grad_accum_steps": _positive_or_none(1, int, "auto: from device_batch"),
    # Most sequences per device and microbatch for grad_accum_steps=None.
    "device_batch": _positive_or_none(None, int, "not set"),
    # None: num_epochs passes over the training set (MQAR only).
    "total_steps": _positive_or_none(None, int, "num_epochs passes"),
    "num_epochs": Field(0, (int,), lambda v: v >= 0, "an int >= 0"),
    "log_every_steps": _positive_int(50),
    "eval_every_steps": _positive_int(1000),
    "checkpoint_every_steps": _positive_int(1000),
    "keep_checkpoints": _positive_int(3),
    # Also checkpoint at the first step after this much wall time since the last save
    # (whatever checkpoint_every_steps says), bounding what a hard kill loses; 0: off.
    "checkpoint_every_minutes": Field(10.0, (float, int), lambda v: v >= 0,
                                      "minutes >= 0 (0: only checkpoint_every_steps)"),
    "async_checkpointing": Field(True, (bool,), _any, "True or False"),
    "log_diagnostics": Field(True, (bool,), _any, "True or False"),  # Mixer statistics per layer.
    # Initial parameters computed on the CPU, then sharded: "auto" (on GPU/TPU, whose
    # compilers take minutes for the per-parameter random init), True, False.
    "init_on_host": Field("auto", (bool, str), lambda v: v in (True, False, "auto"),
                          "'auto', True or False"),
    # Stop once an evaluation reaches this accuracy; None: never.
    "early_stop_accuracy": Field(None, (float, type(None)), lambda v: v is None or 0 < v <= 1,
                                 "a number in (0, 1], or None (never stop early)"),
    # A conversion output whose parameters start the run (configs/finetune.py); "": none.
    "init_from": Field("", (str,), _any, "a directory, or '' for a fresh initialisation"),
}

OPTIMIZER_FIELDS = {
    "learning_rate": Field(REQUIRED, (float,), lambda v: v > 0, "> 0"),
    "warmup_fraction": _fraction(0.0),  # Of the schedule's horizon (decay_steps).
    # The cosine's horizon, warmup included; None: total_steps.
    "decay_steps": _positive_or_none(None, int, "total_steps"),
    "end_fraction": _fraction(0.0),  # The final learning rate, as a fraction of the peak.
    "b1": Field(0.9, (float,), lambda v: 0 <= v < 1, "in [0, 1)"),
    "b2": Field(0.999, (float,), lambda v: 0 <= v < 1, "in [0, 1)"),
    "eps": Field(1e-8, (float,), lambda v: v >= 0, ">= 0"),
    "weight_decay": Field(0.1, (float,), lambda v: v >= 0, ">= 0"),
    "clip_norm": _positive_or_none(1.0, float, "no clipping"),
    # Fine-tuning: the first steps train only the new metaplastic parameters.
    "new_params_only_steps": Field(0, (int,), lambda v: v >= 0, "an int >= 0"),
}

MESH_FIELDS = {
    "data": _mesh_axis(-1),
    "fsdp": _mesh_axis(1),
    "sequence": _mesh_axis(1),  # > 1: each sequence split over that many devices.
    "tensor": _mesh_axis(1),
    # (logical axis, mesh axis or None) pairs over training/sharding.py's DEFAULT_RULES.
    "rules": Field((), (tuple, list), _any, "a sequence of (logical axis, mesh axis) pairs"),
}

DATA_FIELDS = {
    "mqar": {  # data/mqar.py's generator.
        "vocab_size": _positive_int(REQUIRED),
        "num_kv_pairs": _positive_int(REQUIRED),
        "num_train_examples": _positive_int(REQUIRED),
        "num_test_examples": _positive_int(REQUIRED),
        "power_a": Field(REQUIRED, (float,), lambda v: v > 0, "> 0"),
        "random_non_queries": Field(REQUIRED, (bool,), _any, "True or False"),
    },
    "lm": {  # data/text.py, data/token_shards.py.
        "train_files": Field("", (str,), bool,
                             "the training text files (a glob, or comma-separated globs)"),
        "eval_files": Field("", (str,), _any, "held-out files, or '' for none"),
        "eval_batches": _positive_int(20),
        # A tokenizer.json path, or "bpe:<vocab>": a byte-level BPE trained on train_files.
        "tokenizer": Field(REQUIRED, (str,), bool, "a tokenizer.json path or 'bpe:<vocab>'"),
    },
}


def _group(fields: dict[str, Field]) -> dict[str, Any]:
  values = {}
  for name, field in fields.items():
    default = None if field.default is REQUIRED else field.default
    if name == "init_on_host":  # "auto" or a bool: a field of no single type.
      default = ml_collections.FieldReference(default, field_type=object)
    elif default is None and type(None) in field.types:  # typed, so --config.<name>=5 parses
      default = ml_collections.config_dict.placeholder(field.types[0])
    values[name] = default
  return values


def base_config(task: str) -> ml_collections.ConfigDict:
  """Every field's default (REQUIRED ones None) for `task` ("mqar" or "lm")."""
  if task not in TASKS:
    raise ValueError(f"task must be one of {TASKS}, got {task!r}.")
  config = ml_collections.ConfigDict(_group(FIELDS))
  config.task = task
  config.optimizer = ml_collections.ConfigDict(_group(OPTIMIZER_FIELDS))
  config.mesh = ml_collections.ConfigDict(_group(MESH_FIELDS))
  config.data = ml_collections.ConfigDict(_group(DATA_FIELDS[task]))
  return config


# Fields where earlier versions wrote a 0 (or less) for today's None: (group, name, "unset" test).
_EARLIER_ZEROS = (
    (None, "total_steps", lambda v: v <= 0), (None, "grad_accum_steps", lambda v: v == 0),
    (None, "device_batch", lambda v: v == 0), (None, "early_stop_accuracy", lambda v: v == 0),
    ("optimizer", "decay_steps", lambda v: v == 0), ("optimizer", "clip_norm", lambda v: v <= 0),
)
# configs/mqar.py arguments where earlier versions wrote 0 for today's None (the paper's layout).
_EARLIER_ARG_ZEROS = ("num_heads", "head_v_dim")


def from_saved(saved: dict[str, Any]) -> ml_collections.ConfigDict:
  """A config.json written by train.py, in today's spelling (earlier runs' too).

  config.args and config.finetune of earlier versions hold arguments under names since
  renamed (config_args.RENAMED, e.g. MQAR's mixer, now model); they are read under the new
  names. Their 0 for a setting that is not set (_EARLIER_ZEROS, _EARLIER_ARG_ZEROS) is read
  as None. config.model is upgraded by the model's own schema (models/config.py, upgrade),
  which the callers above this floor apply.
  """
  saved = dict(saved)
  if isinstance(saved.get("optimizer"), dict):
    saved["optimizer"] = dict(saved["optimizer"])
  for group, name, unset in _EARLIER_ZEROS:
    fields = saved.get(group, {}) if group else saved
    value = fields.get(name) if isinstance(fields, dict) else None
    if isinstance(value, (int, float)) and unset(value):
      fields[name] = None
  renamed = config_args.RENAMED_LM if saved.get("task") == "lm" else None
  if isinstance(saved.get("args"), dict):
    saved["args"] = config_args.upgrade_args(saved["args"], renamed)
    for name in _EARLIER_ARG_ZEROS:
      if saved["args"].get(name) == 0:
        saved["args"][name] = None
  if isinstance(saved.get("finetune"), dict):
    saved["finetune"] = config_args.upgrade_args(saved["finetune"])
  return ml_collections.ConfigDict(saved)


def _is_type(value: Any, types: tuple[type, ...]) -> bool:
  if isinstance(value, bool):
    return bool in types
  if float in types and isinstance(value, int):
    return True
  return isinstance(value, types)


def check_group(group: ml_collections.ConfigDict, fields: dict[str, Field],
                prefix: str) -> None:
  """Raises ConfigError for the first field of `group` that is unknown, missing or bad."""
  unknown = sorted(set(group) - set(fields))
  if unknown:
    raise ConfigError(f"{prefix}{unknown[0]} is not a config field; the fields of "
                     f"{prefix.rstrip('.')} are {', '.join(fields)}.")
  for name, field in fields.items():
    if name not in group:
      raise ConfigError(f"{prefix}{name} is missing; expected {field.expected}.")
    value = group[name]
    if not (_is_type(value, field.types) and field.check(value)):
      raise ConfigError(f"{prefix}{name} must be {field.expected}, got {value!r}.")


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError naming the first field of `config` that is missing, unknown or bad.

  Order: the top-level fields, the run length, then optimizer, mesh and data.
  """
  top = {k: v for k, v in config.items()
         if k not in FREE_GROUPS and k not in ("optimizer", "mesh", "data")}
  check_group(top, FIELDS, "config.")
  if "model" not in config:
    raise ConfigError("config.model is missing; expected the model config "
                     "(models/config.py).")
  if config.total_steps is None and config.num_epochs <= 0:
    raise ConfigError(
        "set config.total_steps (> 0) or config.num_epochs (> 0); got "
        f"total_steps={config.total_steps}, num_epochs={config.num_epochs}.")
  if config.task == "lm" and config.total_steps is None:
    raise ConfigError(
        "the lm task streams its data without epochs: config.total_steps must be "
        f"> 0, got {config.total_steps} (config.num_epochs is ignored).")
  for name, fields in (("optimizer", OPTIMIZER_FIELDS), ("mesh", MESH_FIELDS),
                       ("data", DATA_FIELDS[config.task])):
    if not isinstance(config.get(name), ml_collections.ConfigDict):
      raise ConfigError(f"config.{name} must be a group of fields "
                       f"({', '.join(fields)}), got {config.get(name)!r}.")
    check_group(config[name], fields, f"config.{name}.")
  if config.task == "mqar" and config.data.num_train_examples < config.batch_size:
    raise ConfigError(
        f"config.data.num_train_examples={config.data.num_train_examples} is smaller "
        f"than config.batch_size={config.batch_size}.")

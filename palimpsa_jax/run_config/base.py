"""The run config: every field the trainer reads, with its default, type and check, once.

configs/mqar.py, configs/lm.py and configs/finetune.py start from `base_config(task)` and set
only what differs. A field whose default is REQUIRED has none: the config file sets it (from
its arguments). `validate` checks a config field by field, once, when a run starts
(training/trainer.py's validate_config) and raises ConfigError naming the first bad field and
what it expects. The checks that need the devices (mesh, batch shards) stay in the trainer.
Each field is a values.Field: the config-file argument of the same name is checked by the same
Field while the config file parses it (`argument_fields`).

A setting that may be "not set" is None there (total_steps: num_epochs passes; grad_accum_steps:
auto; device_batch, decay_steps, clip_norm, early_stop_accuracy: none), never a 0 that means
something else; `from_saved` reads the zeros that earlier versions wrote for these as None.

The groups config.model (its schema is models/config.py's, checked by the model builder),
config.args and config.finetune (the config file's own arguments, already checked when parsed)
are not described here.
"""

import json
from typing import Any

import ml_collections

from palimpsa_jax import user_errors
from palimpsa_jax.run_config import config_args
from palimpsa_jax.run_config.values import (REQUIRED, Field, anything, at_least, flag,
                                            in_interval, one_of, or_none, positive)

TASKS = ("mqar", "lm")


class ConfigError(ValueError, user_errors.UserError):
  """A run config the trainer refuses; the message names the field and what it expects."""


# Groups of fields the trainer does not read (see the module docstring).
FREE_GROUPS = ("model", "args", "finetune")


def _mesh_axis(default: int) -> Field:
  return Field(default, (int,), lambda v: v == -1 or v > 0,
               "a positive int, or -1 for the remaining devices")


# The top-level fields; "data" holds DATA_FIELDS[task].
FIELDS = {
    "task": one_of(REQUIRED, TASKS),
    "seed": anything(REQUIRED, int),
    "seq_len": at_least(2),  # A row predicts its tokens 2.. from the ones before.
    "batch_size": positive(),  # Global, in sequences.
    "eval_batch_size": positive(),  # Global, in sequences.
    # None: as many microbatches as keep each device at device_batch sequences or fewer.
    "grad_accum_steps": or_none(positive(), "auto: from device_batch", default=1),
    # Most sequences per device and microbatch for grad_accum_steps=None.
    "device_batch": or_none(positive(), "not set"),
    # None: num_epochs passes over the training set (MQAR only).
    "total_steps": or_none(positive(), "num_epochs passes"),
    "num_epochs": at_least(0, 0),
    "log_every_steps": positive(50),
    "eval_every_steps": positive(1000),
    "checkpoint_every_steps": positive(1000),
    "keep_checkpoints": positive(3),
    # Also checkpoint at the first step after this much wall time since the last save
    # (whatever checkpoint_every_steps says), bounding what a hard kill loses; 0: off.
    "checkpoint_every_minutes": Field(10.0, (float, int), lambda v: v >= 0,
                                      "minutes >= 0 (0: only checkpoint_every_steps)"),
    "async_checkpointing": flag(True),
    "log_diagnostics": flag(True),  # Mixer statistics per layer.
    # Initial parameters computed on the CPU, then sharded: "auto" (on GPU/TPU, whose
    # compilers take minutes for the per-parameter random init), True, False.
    "init_on_host": Field("auto", (bool, str), lambda v: v in (True, False, "auto"),
                          "'auto', True or False"),
    # Stop once an evaluation reaches this accuracy; None: never.
    "early_stop_accuracy": or_none(in_interval(0, 1, low_closed=False), "never stop early"),
    # A conversion output whose parameters start the run (configs/finetune.py); "": none.
    "init_from": Field("", (str,), lambda _: True,
                       "a directory, or '' for a fresh initialisation"),
}

OPTIMIZER_FIELDS = {
    "learning_rate": positive(kind=float),
    "warmup_fraction": in_interval(0, 1, 0.0),  # Of the schedule's horizon (decay_steps).
    # The cosine's horizon, warmup included; None: total_steps.
    "decay_steps": or_none(positive(), "total_steps"),
    "end_fraction": in_interval(0, 1, 0.0),  # The final learning rate, a fraction of the peak.
    "b1": in_interval(0, 1, 0.9, high_closed=False),
    "b2": in_interval(0, 1, 0.999, high_closed=False),
    "eps": at_least(0, 1e-8, float),
    "weight_decay": at_least(0, 0.1, float),
    "clip_norm": or_none(positive(kind=float), "no clipping", default=1.0),
    # Fine-tuning: the first steps train only the new metaplastic parameters.
    "new_params_only_steps": at_least(0, 0),
}

MESH_FIELDS = {
    "data": _mesh_axis(-1),
    "fsdp": _mesh_axis(1),
    "sequence": _mesh_axis(1),  # > 1: each sequence split over that many devices.
    "tensor": _mesh_axis(1),
    # (logical axis, mesh axis or None) pairs over training/sharding.py's DEFAULT_RULES.
    "rules": Field((), (tuple, list), lambda _: True,
                   "a sequence of (logical axis, mesh axis) pairs"),
}

DATA_FIELDS = {
    "mqar": {  # data/mqar.py's generator.
        "vocab_size": positive(),
        "num_kv_pairs": positive(),
        "num_train_examples": positive(),
        "num_test_examples": positive(),
        "power_a": positive(kind=float),
        "random_non_queries": flag(REQUIRED),
    },
    "lm": {  # data/text.py, data/token_shards.py.
        "train_files": Field("", (str,), bool,
                             "the training text files (a glob, or comma-separated globs)"),
        "eval_files": Field("", (str,), lambda _: True, "held-out files, or '' for none"),
        "eval_batches": positive(20),
        # A tokenizer.json path, or "bpe:<vocab>": a byte-level BPE trained on train_files.
        "tokenizer": Field(REQUIRED, (str,), bool, "a tokenizer.json path or 'bpe:<vocab>'"),
    },
}


def argument_fields(task: str) -> dict[str, Field]:
  """{name: Field} of the run-config fields a config-file argument of that name sets (the
  top-level, optimizer and data fields of `task`), for config_args.parse_config_arg."""
  return {**FIELDS, **OPTIMIZER_FIELDS, **DATA_FIELDS[task]}


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


def read_saved(path: str, text: str) -> dict[str, Any]:
  """The JSON object `text` read from `path` (a config.json or conversion.json the project
  wrote); ConfigError naming the file when it is not one (cut short by a full disk, edited)."""
  try:
    saved = json.loads(text)
  except json.JSONDecodeError as error:
    raise ConfigError(f"{path} is not valid JSON ({error.msg}: line {error.lineno}, "
                      f"column {error.colno}): the file was cut short or edited.") from None
  if not isinstance(saved, dict):
    raise ConfigError(f"{path} holds a {type(saved).__name__}, not a JSON object of settings.")
  return saved


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
    if not field.accepts(value):
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

"""big_vision-style config arguments: `--config configs/x.py:key=value,key=value`.

One spelling per setting: an argument that sets a run-config field has that field's name
(learning_rate sets config.optimizer.learning_rate, implementation config.model.implementation).
Arguments without a field of their own (preset, model, size, tokens, warmup_steps, ...) are
documented in their config file. RENAMED maps the spellings of earlier versions to today's:
a command that uses one is refused naming the new one, and a saved config.json that holds one
is read under the new one (`upgrade_args`). REMOVED lists arguments that no longer exist: a
command that gives one is refused saying why; a saved config.json keeps it as a record.
"""

from collections.abc import Mapping
from typing import Any

import ml_collections

from palimpsa_jax import user_errors
from palimpsa_jax.run_config import values

# Earlier argument names -> today's (configs/mqar.py, configs/lm.py, configs/finetune.py).
RENAMED = {
    "lr": "learning_rate",
    "impl": "implementation",
    "matmul": "matmul_precision",
    "batch": "batch_size",
    "steps": "total_steps",
    "epochs": "num_epochs",
    "early_stop": "early_stop_accuracy",
    "kv": "num_kv_pairs",
    "vocab": "vocab_size",
    "examples": "num_train_examples",
    "test_examples": "num_test_examples",
    "heads": "num_heads",
    "head_v": "head_v_dim",
    "mixer": "model",  # configs/mqar.py chose the model as mixer=
}
# Earlier arguments with no successor -> why they went.
REMOVED = {
    "head_loss": "the token loss has one implementation for training now "
                 "(palimpsa_jax/ops/token_loss)",
}
# configs/lm.py's `warmup` counted steps, the others' a fraction of the run.
RENAMED_LM = {**RENAMED, "warmup": "warmup_steps"}
RENAMED_FRACTION = {**RENAMED, "warmup": "warmup_fraction"}


class ConfigArgumentError(ValueError, user_errors.UserError):
  """A config-file argument that is unknown, renamed or of the wrong type."""


def renamed_message(key: str, new: str) -> str:
  return f"config argument {key} is now called {new} (e.g. {new}=<value>)."


def upgrade_args(args: dict[str, Any], renamed: dict[str, str] | None = None) -> dict[str, Any]:
  """`args` (a saved config.json's config.args) with earlier names replaced by today's."""
  renamed = RENAMED_FRACTION if renamed is None else renamed
  return {renamed.get(key, key): value for key, value in args.items()}


def _convert(key: str, text: str, default: Any) -> Any:
  if isinstance(default, ml_collections.FieldReference):  # a setting that may be None
    if text.lower() == "none":
      return None
    return _convert(key, text, default.get_type()())
  if isinstance(default, bool):
    if text.lower() in ("1", "true", "yes"):
      return True
    if text.lower() in ("0", "false", "no"):
      return False
    raise ConfigArgumentError(f"config argument {key}={text!r} must be a bool (true/false).")
  try:
    if isinstance(default, int):
      return int(float(text)) if float(text).is_integer() else int(text)
    if isinstance(default, float):
      return float(text)
  except ValueError:
    raise ConfigArgumentError(
        f"config argument {key}={text!r} must be "
        f"{'an int' if isinstance(default, int) else 'a float'}.") from None
  return text


def parse_config_arg(arg: str | None, renamed: dict[str, str] | None = None,
                     fields: Mapping[str, values.Field] | None = None,
                     **defaults: Any) -> ml_collections.ConfigDict:
  """Parses "k=v,k=v" into a ConfigDict of `defaults` updated by the arguments.

  Values take the type of their default (a FieldReference's field type: then also "none");
  a given value must be one its Field in `fields` accepts (the run-config field it sets, or
  the argument's own). Unknown keys, values of another type and refused values raise
  ConfigArgumentError; an unknown key names the new spelling of a key in `renamed` (default
  RENAMED_FRACTION).
  """
  fields = fields or {}
  renamed = RENAMED_FRACTION if renamed is None else renamed
  # Fresh FieldReferences: setting a field of the result must not change `defaults`.
  args = {key: ml_collections.FieldReference(value.get(), field_type=value.get_type())
          if isinstance(value, ml_collections.FieldReference) else value
          for key, value in defaults.items()}
  for item in (arg or "").split(","):
    if not item.strip():
      continue
    if "=" not in item:
      raise ConfigArgumentError(f"config argument {item!r} must look like key=value.")
    key, text = (s.strip() for s in item.split("=", 1))
    if key not in defaults and renamed.get(key) in defaults:
      raise ConfigArgumentError(renamed_message(key, renamed[key]))
    if key not in defaults and key in REMOVED:
      raise ConfigArgumentError(f"config argument {key} was removed: {REMOVED[key]}.")
    if key not in defaults:
      raise ConfigArgumentError(
          f"unknown config argument {key!r}; known: {sorted(defaults)}.")
    args[key] = _convert(key, text, defaults[key])
    if key in fields and not fields[key].accepts(args[key]):
      raise ConfigArgumentError(
          f"config argument {key}={text} must be {fields[key].expected}.")
  return ml_collections.ConfigDict(args)


def given_keys(arg: str | None) -> set[str]:
  """The keys set explicitly in "k=v,k=v" (to let presets fill in the rest)."""
  return {item.split("=", 1)[0].strip() for item in (arg or "").split(",")
          if "=" in item}

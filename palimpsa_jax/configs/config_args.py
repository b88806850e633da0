"""big_vision-style config arguments: `--config configs/x.py:key=value,key=value`."""

from typing import Any

import ml_collections


def _convert(key: str, text: str, default: Any) -> Any:
  if isinstance(default, bool):
    if text.lower() in ("1", "true", "yes"):
      return True
    if text.lower() in ("0", "false", "no"):
      return False
    raise ValueError(f"config argument {key}={text!r} must be a bool (true/false).")
  try:
    if isinstance(default, int):
      return int(float(text)) if float(text).is_integer() else int(text)
    if isinstance(default, float):
      return float(text)
  except ValueError:
    raise ValueError(
        f"config argument {key}={text!r} must be "
        f"{'an int' if isinstance(default, int) else 'a float'}.") from None
  return text


def parse_config_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
  """Parses "k=v,k=v" into a ConfigDict of `defaults` updated by the arguments.

  Values take the type of their default; unknown keys raise ValueError.
  """
  args = dict(defaults)
  for item in (arg or "").split(","):
    if not item.strip():
      continue
    if "=" not in item:
      raise ValueError(f"config argument {item!r} must look like key=value.")
    key, text = (s.strip() for s in item.split("=", 1))
    if key not in defaults:
      raise ValueError(
          f"unknown config argument {key!r}; known: {sorted(defaults)}.")
    args[key] = _convert(key, text, defaults[key])
  return ml_collections.ConfigDict(args)


def given_keys(arg: str | None) -> set[str]:
  """The keys set explicitly in "k=v,k=v" (to let presets fill in the rest)."""
  return {item.split("=", 1)[0].strip() for item in (arg or "").split(",")
          if "=" in item}

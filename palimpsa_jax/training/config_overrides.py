"""train.py's `--config.<field>=value` overrides, checked with short messages.

  user_errors.run_app("train.py", main, flags_parser=config_overrides.parse_flags)

An override of a field that does not exist stops with one line naming it and
the nearest known fields, or the field an earlier spelling is now called
(`--config.lr` -> --config.optimizer.learning_rate). An override of config.args
(or config.finetune) is refused: those record the config file's arguments, from which the other fields
were already derived, so changing them afterwards would change nothing but
config.json; the message gives the config-argument form that does work.
A config file that refuses its arguments (`--config=configs/mqar.py:num_kv_pairs=abc`)
stops with its one-line message, not the file's traceback, and so does a file that is no
config file (not Python, or without get_config). These refusals are raised as
user_errors.UserError, and wrong override types as absl's flags.Error, for the entry point
to report in one line (user_errors.run_app).
"""

import difflib
import re

from absl import flags
import ml_collections

from palimpsa_jax import user_errors
from palimpsa_jax.run_config import config_args

# Top-level fields that hold a config file's arguments (configs/*.py: args;
# configs/finetune.py: finetune).
ARGUMENT_FIELDS = ("args", "finetune")


def overrides(argv: list[str]) -> dict[str, str | None]:
  """{dotted field path: value text, or None} of the `--config.<path>=value` flags."""
  found = {}
  pattern = re.compile(r"^--?(?:no)?config\.([^=]+)(?:=(.*))?$", re.DOTALL)
  for arg in argv:
    match = pattern.match(arg)
    if match:
      found[match.group(1)] = match.group(2)
  return found


def config_argument(argv: list[str]) -> str | None:
  """The value of `--config=path[:args]` or `--config path[:args]` in argv."""
  for i, arg in enumerate(argv):
    for prefix in ("--config=", "-config="):
      if arg.startswith(prefix):
        return arg[len(prefix):]
    if arg in ("--config", "-config") and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _argument_form(config_arg: str | None, key: str, value: str | None) -> str:
  """`--config=file[:args],key=value`: the config-argument form of key=value."""
  file = config_arg or "configs/<file>.py"
  separator = "," if ":" in file else ":"
  return f"--config={file}{separator}{key}={'<value>' if value is None else value}"


def argument_field_message(path: str, value: str | None, config_arg: str | None) -> str:
  """Why `--config.<path>` (under an argument field) is refused, and what to write."""
  field, _, key = path.partition(".")
  key = config_args.RENAMED.get(key, key)
  return (
      f"--config.{path} would not change the run: config.{field} records the "
      "arguments of the config file, from which the other fields were derived. "
      "Give it as a config argument instead: "
      f"{_argument_form(config_arg, key or '<key>', value)}")


def _paths(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  paths = []
  for key, value in config.items():
    path = f"{prefix}{key}"
    paths.append(path)
    if isinstance(value, ml_collections.ConfigDict):
      paths.extend(_paths(value, path + "."))
  return paths


def unknown_field_message(config: ml_collections.ConfigDict, path: str) -> str | None:
  """A one-line message if `path` is not a field of `config`; None if it is."""
  node, walked = config, []
  for part in path.split("."):
    if not isinstance(node, ml_collections.ConfigDict):
      return (f"--config.{path}: no such config field; config.{'.'.join(walked)} "
              f"is a value of type {type(node).__name__}, not a group of fields.")
    if part not in node:
      break
    node = node[part]
    walked.append(part)
  else:
    return None
  fields = [p for p in _paths(config) if p.split(".")[0] not in ARGUMENT_FIELDS]
  if part in config_args.RENAMED:  # an earlier spelling
    new = config_args.RENAMED[part]
    where = [f"--config.{p}" for p in fields if p.split(".")[-1] == new]
    return (f"--config.{path}: no such config field; {part} is now called {new}"
            f"{': ' + ', '.join(where) if where else ''}.")
  prefix = "".join(f"{p}." for p in walked)
  near = [prefix + key for key in difflib.get_close_matches(part, list(node), n=3)]
  if not near:  # the same name elsewhere in the config
    near = [p for p in fields
            if difflib.SequenceMatcher(None, part, p.split(".")[-1]).ratio() >= 0.8][:3]
  if near:
    return (f"--config.{path}: no such config field; nearest: "
            f"{', '.join(f'--config.{p}' for p in near)}.")
  return (f"--config.{path}: no such config field; the fields of "
          f"{'.'.join(['config', *walked])} are {', '.join(sorted(node))}.")


def _error_line(error: Exception) -> str:
  """The message of the error ml_collections re-raised with the config file's traceback."""
  last = str(error).strip().splitlines()[-1].strip()
  return re.sub(r"^[\w.]+(Error|Exception): ", "", last)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (app.run's flags_parser), with the checks above.

  Raises:
    user_errors.UserError: a refused or unknown override, or a config file's refused argument.
    flags.Error: absl's refusal of a flag (unknown, of the wrong type, missing).
  """
  config_arg = config_argument(argv)
  if config_arg:
    try:
      flags.FLAGS["config"].parser.parse(config_arg)
    except ValueError as refused:
      raise user_errors.UserError(f"--config={config_arg}: {_error_line(refused)}") from None
    except SyntaxError as error:  # README.md, say: not Python
      raise user_errors.UserError(
          f"--config={config_arg}: {error.filename} is not a Python config file "
          f"(line {error.lineno}: {error.msg}).") from None
    except AttributeError as error:
      if "get_config" not in str(error):
        raise
      raise user_errors.UserError(
          f"--config={config_arg}: the file defines no get_config(arg), which a config "
          "file provides (configs/*.py).") from None
  found = overrides(argv)
  for path, value in found.items():
    if path.split(".")[0] in ARGUMENT_FIELDS:
      raise user_errors.UserError(argument_field_message(path, value, config_argument(argv)))
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError):  # ml_collections' error for a missing field
    config = flags.FLAGS["config"].parser.parse(config_arg)
    for path in found:
      message = unknown_field_message(config, path)
      if message:
        raise user_errors.UserError(message) from None
    raise

"""The errors a user fixes by changing the command, and how every entry point reports them.

UserError is the base of the project's refusals (a config field, a checkpoint that cannot be
read, data that is not UTF-8 text); together with a path that is missing, not a directory, or
not writable (OSError), absl's flag errors (flags.Error, app.UsageError) and argparse's
(`ArgumentParser`), they are reported by `report` as one line, "program: message", on stderr
with exit status 1. --verbose (or PALIMPSA_TRACEBACK=1) shows the traceback instead.

  run_app("train.py", main)          an absl entry point: flag errors, refusals raised by main,
                                     -h / --help shows the help and exits 0
  one_line("prepare", function)      any other command's function, its refusals one line
  ArgumentParser(prog=...)           argparse whose usage errors are refusals too
  precheck(...)                      a missing config file or an unusable output directory,
                                     answered before an entry point's heavy imports
  check_output_file(path, label)     an output file that cannot be written, before the work
"""

import argparse
from collections.abc import Callable, Sequence
import os
import re
import sys
from typing import Any, NoReturn

from absl import app
from absl import flags

TRACEBACK_VARIABLE = "PALIMPSA_TRACEBACK"


class UserError(Exception):
  """A refusal whose message says what to change; reported without a traceback."""


# A missing path, a file where a directory is expected (or the reverse), no permission.
PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError,
               PermissionError)
# Everything `one_line` reports as one line.
REFUSALS = (UserError, app.UsageError, flags.Error, *PATH_ERRORS)

_HELP_FLAGS = ("-h", "-help", "--help", "-?", "--helpshort", "-helpshort", "--helpfull",
               "-helpfull", "--helpxml", "-helpxml")
_REQUIRED = re.compile(r"Flag --([\w.]+) must have a value other than None\.")
_NOT_A_NUMBER = re.compile(
    r"^flag (--[\w.]+=.*): (?:invalid literal for int\(\) with base \d+"
    r"|could not convert string to (float)): '.*'$", re.DOTALL)


def message(error: BaseException) -> str:
  """The error as one line: its message, "strerror: path" for an OSError, or a flag error in
  the words of the command line (`--workdir is required`, `--n=x: expected an int`)."""
  if isinstance(error, OSError) and error.strerror and error.filename:
    text = f"{error.strerror}: {error.filename}"
  elif isinstance(error, flags.UnrecognizedFlagError):
    text = f"unknown flag --{error.flagname}"
    suggestion = str(error).partition("Did you mean: ")[2].rstrip(" ?")
    text += f" (did you mean --{suggestion}?)" if suggestion else " (--help lists the flags)"
  else:
    text = str(error)
    if isinstance(error, flags.Error):
      if required := _REQUIRED.findall(text):
        text = (f"{', '.join('--' + name for name in required)} "
                f"{'is' if len(required) == 1 else 'are'} required (--help lists the flags)")
      elif number := _NOT_A_NUMBER.match(text):
        text = f"{number.group(1)}: expected {'a number' if number.group(2) else 'an int'}"
      else:
        text = text.removeprefix("flag ")
  return " ".join(text.split())


def wants_traceback(argv: Sequence[str] = ()) -> bool:
  """Whether the user asked for tracebacks: PALIMPSA_TRACEBACK, or --verbose in argv."""
  return bool(os.environ.get(TRACEBACK_VARIABLE)) or any(
      arg in ("--verbose", "-verbose", "--verbose=true", "--verbose=1") for arg in argv)


def report(program: str, error: BaseException) -> NoReturn:
  """Prints "program: message" on stderr and exits with status 1."""
  print(f"{program}: {message(error)}", file=sys.stderr, flush=True)
  sys.exit(1)


def one_line(program: str, main: Callable[..., Any],
             verbose: Callable[[], bool] = lambda: False) -> Callable[..., Any]:
  """`main` reporting its refusals (REFUSALS) with `report`, unless tracebacks are wanted.

  Args:
    program: the command's name, e.g. "train.py".
    main: the entry point's main function.
    verbose: whether the user asked for tracebacks (e.g. a --verbose flag's value).
  """
  def run(*args, **kwargs):
    try:
      return main(*args, **kwargs)
    except REFUSALS as error:
      if verbose() or wants_traceback():
        raise
      report(program, error)
  return run


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose usage errors raise UserError (so `one_line` prints them in one line)
  instead of printing the usage and exiting with status 2."""

  def error(self, message: str) -> NoReturn:  # pylint: disable=redefined-outer-name
    raise UserError(f"{message} (--help lists the arguments)")


def _check_creatable(directory: str, label: str) -> None:
  """Raises NotADirectoryError or PermissionError unless `directory` is (or can be made) a
  writable directory; the message starts with `label`."""
  existing = directory
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise NotADirectoryError(f"{label}: {existing} is a file, not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise PermissionError(f"{label}: {existing} is not writable")


def check_output_dir(path: str, flag: str) -> None:
  """Raises NotADirectoryError or PermissionError unless `path` is (or can be made) a
  writable directory; names `flag` (e.g. "--workdir")."""
  path = os.path.abspath(path)
  _check_creatable(path, f"{flag}={path}")


def check_output_file(path: str, label: str) -> None:
  """Raises IsADirectoryError, NotADirectoryError or PermissionError unless the file `path`
  can be written (created, or replaced) in a writable directory; the message starts with
  `label` (e.g. "--output=<path>")."""
  path = os.path.abspath(path)
  if os.path.isdir(path):
    raise IsADirectoryError(f"{label}: a directory, not a file")
  _check_creatable(os.path.dirname(path), label)
  if os.path.exists(path) and not os.access(path, os.W_OK):
    raise PermissionError(f"{label}: the file is not writable")


def _flag_value(argv: Sequence[str], name: str) -> str | None:
  """The value of --name=value or --name value in argv (the last one given)."""
  value = None
  for i, arg in enumerate(argv):
    for prefix in (f"--{name}=", f"-{name}="):
      if arg.startswith(prefix):
        value = arg[len(prefix):]
    if arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
      value = argv[i + 1]
  return value


def precheck(program: str, argv: Sequence[str], config_flag: str | None = None,
             output_dirs: Sequence[str] = ()) -> None:
  """Exits with one line if --config_flag's file (path[:args]) is missing or an output
  directory flag names a file or an unwritable place; needs nothing heavy to import.
  """
  if any(arg in _HELP_FLAGS for arg in argv[1:]):
    return
  try:
    config = _flag_value(argv, config_flag) if config_flag else None
    if config:
      path = config.split(":", 1)[0]
      if not os.path.isfile(path):
        raise FileNotFoundError(f"--{config_flag}={config}: no config file {path}")
    for name in output_dirs:
      value = _flag_value(argv, name)
      if value:
        check_output_dir(value, f"--{name}")
  except PATH_ERRORS as error:
    if wants_traceback(argv):
      raise
    report(program, error)


def dash_h_as_help(argv: Sequence[str]) -> list[str]:
  """argv with each -h that is a flag (not the value of the flag before it, nor after "--")
  spelled --help, which absl knows."""
  out = list(argv[:1])
  for i, arg in enumerate(argv[1:], 1):
    previous = argv[i - 1].lstrip("-")
    is_value = (i > 1 and argv[i - 1].startswith("-") and "=" not in previous
                and previous in flags.FLAGS and not flags.FLAGS[previous].boolean)
    if "--" in argv[1:i]:
      is_value = True
    out.append("--help" if arg == "-h" and not is_value else arg)
  return out


def run_app(program: str, main: Callable[[list[str]], Any],
            flags_parser: Callable[[list[str]], Any] | None = None) -> None:
  """absl's app.run(main) for an entry point named `program`.

  Flag errors (absl's, or refusals raised by `flags_parser`) and refusals raised by `main`
  are reported by `report`; a --verbose flag shows their tracebacks. -h is --help, and the
  help exits with status 0 (absl's is 1).
  """
  if "verbose" not in flags.FLAGS:
    flags.DEFINE_bool("verbose", False, "Show the traceback of a refused command.",
                      module_name=sys.argv[0])  # listed by -h with the command's own flags
  argv = dash_h_as_help(sys.argv)
  parse = flags_parser or flags.FLAGS

  def parse_flags(argv: list[str]) -> Any:
    try:
      return parse(argv)
    except SystemExit as exit_:  # absl's help flags print the help, then exit(1)
      if exit_.code == 1 and any(arg in _HELP_FLAGS for arg in argv[1:]):
        sys.exit(0)
      raise

  try:
    app.run(one_line(program, main, verbose=lambda: flags.FLAGS.verbose), argv=argv,
            flags_parser=one_line(program, parse_flags, verbose=lambda: wants_traceback(argv)))
  except BrokenPipeError:
    # The reader of the output went away (`train.py -h | head`): stop without a traceback,
    # and let the interpreter's last flush write to nowhere.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(1)

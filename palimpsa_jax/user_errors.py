"""The errors a user fixes by changing the command, and how the entry points report them.

UserError is the base of the project's refusals (a config field, a checkpoint that cannot be
read, data without text); together with a path that is missing, not a directory, or not
writable (OSError), they are reported by `one_line` as one line on stderr and exit status 1.
--verbose or PALIMPSA_TRACEBACK=1 shows the traceback instead. `run_app` runs an absl entry
point that way (and --help exits 0); `precheck` answers a missing config file or an unusable
output directory before an entry point's heavy imports.
"""

from collections.abc import Callable, Sequence
import os
import sys
from typing import Any

from absl import app
from absl import flags

TRACEBACK_VARIABLE = "PALIMPSA_TRACEBACK"


class UserError(Exception):
  """A refusal whose message says what to change; reported without a traceback."""


# A missing path, a file where a directory is expected (or the reverse), no permission.
PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError,
               PermissionError)


def message(error: BaseException) -> str:
  """The error as one line: its message, or "strerror: path" for an OSError."""
  if isinstance(error, OSError) and error.strerror and error.filename:
    text = f"{error.strerror}: {error.filename}"
  else:
    text = str(error)
  return " ".join(text.split())


def one_line(program: str, main: Callable[..., Any],
             verbose: Callable[[], bool] = lambda: False) -> Callable[..., Any]:
  """`main` reporting user errors as "program: message" on stderr, exit status 1.

  Args:
    program: the command's name, e.g. "train.py".
    main: the entry point's main function.
    verbose: whether the user asked for tracebacks (e.g. a --verbose flag's value).
  """
  def run(*args, **kwargs):
    try:
      return main(*args, **kwargs)
    except (UserError, *PATH_ERRORS) as error:
      if verbose() or os.environ.get(TRACEBACK_VARIABLE):
        raise
      print(f"{program}: {message(error)}", file=sys.stderr, flush=True)
      sys.exit(1)
  return run


def check_output_dir(path: str, flag: str) -> None:
  """Raises NotADirectoryError or PermissionError unless `path` is (or can be made) a
  writable directory; names `flag` (e.g. "--workdir")."""
  path = os.path.abspath(path)
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise NotADirectoryError(
        f"{flag}={path}: {existing} is a file, not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise PermissionError(f"{flag}={path}: {existing} is not writable")


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
  directory flag names a file or an unwritable place; needs nothing but the standard library.
  """
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
    if os.environ.get(TRACEBACK_VARIABLE):
      raise
    print(f"{program}: {message(error)}", file=sys.stderr, flush=True)
    sys.exit(1)


_HELP_FLAGS = ("-h", "-help", "--help", "-?", "--helpshort", "--helpfull", "-helpfull")


def run_app(program: str, main: Callable[[list[str]], Any], **run_kwargs) -> None:
  """absl's app.run(main) with one-line user errors (see `one_line`), a --verbose flag
  that shows their tracebacks, and exit status 0 after --help (absl's is 1)."""
  if "verbose" not in flags.FLAGS:
    flags.DEFINE_bool("verbose", False, "Show the traceback of a refused command.")
  wrapped = one_line(program, main, verbose=lambda: flags.FLAGS.verbose)
  try:
    app.run(wrapped, **run_kwargs)
  except SystemExit as exit_:
    if exit_.code == 1 and any(arg in _HELP_FLAGS for arg in sys.argv[1:]):
      sys.exit(0)
    raise

"""palimpsa_jax/user_errors.py: every kind of refusal as one line, "program: message"."""

import pathlib
import subprocess
import sys

from absl import app
from absl import flags
import pytest

from palimpsa_jax import user_errors

REPO = pathlib.Path(__file__).resolve().parents[1]


def _flag_error(argv, **required):
  values = flags.FlagValues()
  flags.DEFINE_integer("steps", 1, "", flag_values=values)
  flags.DEFINE_float("rate", 1.0, "", flag_values=values)
  flags.DEFINE_enum("suite", "a", ["a", "b"], "", flag_values=values)
  flags.DEFINE_string("workdir", None, "", flag_values=values)
  flags.DEFINE_string("dest", None, "", flag_values=values)
  for name in required:
    flags.mark_flag_as_required(name, flag_values=values)
  with pytest.raises(flags.Error) as error:
    values(["program", *argv])
  return user_errors.message(error.value)


def test_absl_flag_errors_in_the_words_of_the_command_line():
  assert _flag_error(["--steps=x"]) == "--steps=x: expected an int"
  assert _flag_error(["--rate=abc"]) == "--rate=abc: expected a number"
  assert _flag_error(["--suite=c"]) == "--suite=c: value should be one of <a|b>"
  assert _flag_error(["--workdr=x"]) == "unknown flag --workdr (did you mean --workdir?)"
  assert _flag_error(["--zzz"]) == "unknown flag --zzz (--help lists the flags)"
  assert _flag_error([], workdir=True) == "--workdir is required (--help lists the flags)"
  assert _flag_error([], workdir=True, dest=True) == (
      "--workdir, --dest are required (--help lists the flags)")


def test_one_line_reports_refusals_and_lets_bugs_through(capsys, monkeypatch):
  monkeypatch.delenv(user_errors.TRACEBACK_VARIABLE, raising=False)
  def refuse(error):
    raise error
  for error, line in [
      (user_errors.UserError("config.x must be > 0,\n got 0."), "config.x must be > 0, got 0."),
      (app.UsageError("--workdir is required."), "--workdir is required."),
      (FileNotFoundError(2, "No such file or directory", "/nope"),
       "No such file or directory: /nope")]:
    with pytest.raises(SystemExit) as exit_:
      user_errors.one_line("tool.py", refuse)(error)
    assert exit_.value.code == 1
    assert capsys.readouterr().err == f"tool.py: {line}\n"
  with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
    user_errors.one_line("tool.py", refuse)(ZeroDivisionError())
  with pytest.raises(user_errors.UserError):  # and so does a refusal under --verbose
    user_errors.one_line("tool.py", refuse, verbose=lambda: True)(user_errors.UserError("x"))
  monkeypatch.setenv(user_errors.TRACEBACK_VARIABLE, "1")
  with pytest.raises(user_errors.UserError):
    user_errors.one_line("tool.py", refuse)(user_errors.UserError("x"))


def test_argparse_usage_errors_are_refusals():
  parser = user_errors.ArgumentParser(prog="tool")
  parser.add_argument("--files", required=True)
  parser.add_argument("--count", type=int)
  with pytest.raises(user_errors.UserError,
                     match=r"^the following arguments are required: --files \(--help"):
    parser.parse_args([])
  with pytest.raises(user_errors.UserError, match="argument --count: invalid int value: 'x'"):
    parser.parse_args(["--files=a", "--count=x"])


def test_wants_traceback_reads_verbose_before_flags_are_parsed(monkeypatch):
  monkeypatch.delenv(user_errors.TRACEBACK_VARIABLE, raising=False)
  assert user_errors.wants_traceback(["train.py", "--verbose"])
  assert not user_errors.wants_traceback(["train.py", "--noverbose", "--workdir=verbose"])


def test_dash_h_is_help_unless_it_is_a_flags_value():
  if "prompt_for_test" not in flags.FLAGS:
    flags.DEFINE_string("prompt_for_test", None, "")
    flags.DEFINE_bool("switch_for_test", False, "")
  assert user_errors.dash_h_as_help(["p", "-h"]) == ["p", "--help"]
  assert user_errors.dash_h_as_help(["p", "--switch_for_test", "-h"]) == [
      "p", "--switch_for_test", "--help"]
  assert user_errors.dash_h_as_help(["p", "--prompt_for_test", "-h"]) == [
      "p", "--prompt_for_test", "-h"]
  assert user_errors.dash_h_as_help(["p", "--", "-h"]) == ["p", "--", "-h"]


def test_a_reader_that_goes_away_ends_the_program_without_a_traceback():
  """`train.py -h | head`: the pipe closes while the command still prints."""
  script = ("import sys\n"
            "from palimpsa_jax import user_errors\n"
            "def main(argv):\n"
            "  raise BrokenPipeError(32, 'Broken pipe')\n"
            "sys.argv = ['prog']\n"
            "user_errors.run_app('prog', main)\n")
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        cwd=REPO, timeout=60, check=False)
  assert (done.returncode, done.stderr) == (1, "")

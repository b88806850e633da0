"""palimpsa_jax/user_errors.py: every kind of refusal as one line, "program: message"."""

import os
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


def _entry_point(*argv, cwd=REPO):
  env = {k: v for k, v in os.environ.items() if k != user_errors.TRACEBACK_VARIABLE}
  return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=cwd,
                        env=env, timeout=300, check=False)


def _corrupt_workdir(root: pathlib.Path, name: str = "run", checkpoints: bool = True
                     ) -> pathlib.Path:
  """A workdir whose config.json was cut short (a full disk, an editor); without
  `checkpoints`, a run killed before its first checkpoint."""
  workdir = root / name
  workdir.mkdir()
  if checkpoints:
    (workdir / "checkpoints").mkdir()
  (workdir / "config.json").write_text('{\n  "batch_size": 32,\n  "data": {\n    "num_kv')
  return workdir


def _tree(directory: pathlib.Path) -> dict[str, bytes | None]:
  """Every file's bytes and every folder (None) under `directory`."""
  return {str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes()
          for p in sorted(directory.rglob("*"))}


# (argv, the line it prints after "program: "), a value error from each place a value comes
# from: a config-file argument, a --config. override, a flag, a file.
REFUSED_VALUES = [
    (["train.py", "--config=configs/mqar.py:batch_size=0", "--dry_run"],
     "--config=configs/mqar.py:batch_size=0: config argument batch_size=0 must be a positive "
     "int."),
    (["train.py", "--config=configs/lm.py:preset=cpu,seq_len=1", "--dry_run"],
     "--config=configs/lm.py:preset=cpu,seq_len=1: config argument seq_len=1 must be an int "
     ">= 2."),
    (["train.py", "--config=configs/mqar.py", "--config.seq_len=1", "--workdir={tmp}/w"],
     "config.seq_len must be an int >= 2, got 1."),
    (["train.py", "--config=README.md", "--dry_run"],
     "--config=README.md: README.md is not a Python config file (line "),
    (["generate.py", "--checkpoint={corrupt}", "--prompt=a"],
     "{corrupt}/config.json is not valid JSON ("),
    (["train.py", "--config=configs/mqar.py", "--workdir={corrupt}"],
     "{corrupt}/config.json is not valid JSON ("),
    (["train.py", "--config=configs/mqar.py", "--workdir={unsaved}"],
     "{unsaved}/config.json is not valid JSON ("),
    (["generate.py", "--checkpoint=runs/x", "--prompt=a", "--max_new_tokens=0"],
     "--max_new_tokens=0: expected a positive int"),
    (["generate.py", "--checkpoint=runs/x", "--prompt=a", "--top_p=1.5"],
     "--top_p=1.5: expected a number in (0, 1]"),
    (["eval.py", "--suite=lm", "--checkpoint=runs/x", "--files=README.md", "--max_length=1"],
     "--max_length=1: expected an int >= 2"),
    (["eval.py", "--suite=long_context", "--checkpoint=runs/x", "--files={tmp}/e.txt"],
     "--files='{tmp}/e.txt': the 1 matched file(s) hold no text (every document is empty)."),
    (["eval.py", "--suite=mqar", "--checkpoint=runs/x", "--output={tmp}/e.txt/out.json"],
     "--output={tmp}/e.txt/out.json: {tmp}/e.txt is a file, not a directory"),
]


@pytest.mark.parametrize("argv, line", REFUSED_VALUES, ids=lambda v: " ".join(v)[:60]
                         if isinstance(v, list) else None)
def test_entry_points_refuse_bad_values_in_one_line(argv, line, tmp_path):
  (tmp_path / "e.txt").write_text("")
  names = {"tmp": str(tmp_path), "corrupt": str(_corrupt_workdir(tmp_path)),
           "unsaved": str(_corrupt_workdir(tmp_path, "unsaved", checkpoints=False))}
  before = _tree(tmp_path)
  done = _entry_point(*(arg.format(**names) for arg in argv))
  assert (done.returncode, done.stdout) == (1, "")
  assert done.stderr.startswith(f"{argv[0]}: {line.format(**names)}"), done.stderr
  assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
  assert _tree(tmp_path) == before  # nothing written


def test_verbose_shows_the_traceback_of_a_refused_value(tmp_path):
  done = _entry_point("generate.py", f"--checkpoint={_corrupt_workdir(tmp_path)}", "--prompt=a",
                      "--verbose")
  assert done.returncode == 1 and "Traceback" in done.stderr
  assert "is not valid JSON" in done.stderr.splitlines()[-1]


def test_an_output_file_is_checked_before_the_work(tmp_path, monkeypatch):
  user_errors.check_output_file(str(tmp_path / "new" / "out.json"), "--output=x")  # creatable
  with pytest.raises(IsADirectoryError, match="^--output=x: a directory, not a file"):
    user_errors.check_output_file(str(tmp_path), "--output=x")
  (tmp_path / "f").write_text("")
  with pytest.raises(NotADirectoryError, match=f"^--output=x: {tmp_path}/f is a file"):
    user_errors.check_output_file(str(tmp_path / "f" / "out.json"), "--output=x")
  # A read-only folder (a read-only mount, or permissions that bind a user other than root).
  monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(tmp_path))
  with pytest.raises(PermissionError, match=f"^--output=x: {tmp_path} is not writable"):
    user_errors.check_output_file(str(tmp_path / "out.json"), "--output=x")

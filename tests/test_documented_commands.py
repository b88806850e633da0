"""The commands the README and the docs pages below give run as written: each one's arguments
are parsed by the program they name (flags, config-file arguments, `--config.` overrides), with
nothing run; and the parameter counts the docs quote are the models' own.

A command is taken from a code block (its shell variables and line continuations resolved) or
an inline code span, when it starts with `python` or `.venv/bin/python`. A command with a
placeholder (`<model>`, `DEST`, `a|b`, `[--limit 100]`, `$size`) is a pattern, not a command,
and is left out, and so is a bare program name (`python -m palimpsa_jax.conversion`). The
inputs a command reads (runs/..., data/...) need not exist: a missing input is not a refused
argument.
"""

import collections
import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = ("README.md", *sorted(str(p.relative_to(REPO)) for p in REPO.glob("docs/**/*.md")))
# Entry points parsed with absl (the others use argparse).
ABSL = ("train.py", "eval.py", "generate.py", "palimpsa_jax.conversion",
        "palimpsa_jax.conversion.torch_models")
_PLACEHOLDER = re.compile(r"<[^>]*>|\||\[|\.\.\.|\$|(?<![\w.])[A-Z][A-Z0-9_]*(?![\w.=])")
_PYTHON = re.compile(r"^(?:\.venv/bin/)?python3?$")
_STARTS_PYTHON = re.compile(r"^(?:\w+=\S*\s+)*(?:\.venv/bin/)?python3?\s")


def _shell_lines(block: str) -> list[str]:
  """The block's commands: continuation lines joined, `&&` chains split, comments dropped."""
  joined = re.sub(r"\\\n\s*", " ", block)
  commands = []
  for line in joined.splitlines():
    line = line.split(" #", 1)[0].strip()
    if line and not line.startswith("#"):
      commands.extend(part.strip() for part in line.split("&&") if part.strip())
  return commands


def _command(text: str, variables: dict[str, str]) -> tuple[str, list[str]] | None:
  """(program, argv) of one shell command that runs a Python entry point, else None."""
  for name, value in variables.items():
    text = text.replace(f"${name}", value)
  if not _STARTS_PYTHON.match(text) or _PLACEHOLDER.search(text):
    return None
  words = shlex.split(text)
  while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value before the program
    words.pop(0)
  if len(words) < 3 or not _PYTHON.match(words[0]) or words[1] == "-":
    return None
  if words[1] == "-m" and words[2] not in ("pytest", "pip"):
    program, argv = words[2], words[3:]
  elif words[1].endswith(".py"):
    program, argv = words[1], words[2:]
  else:
    return None
  # Without a flag it names the program (and its subcommand), as prose does.
  return (program, argv) if any(arg.startswith("-") for arg in argv) else None


def documented_commands(page: str) -> list[tuple[str, list[str]]]:
  """(program, argv) of every command of `page` (see the module docstring)."""
  text = (REPO / page).read_text()
  blocks = re.findall(r"```\w*\n(.*?)```", text, re.DOTALL)
  prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
  indented = re.findall(r"(?:^(?: {4}.*)?\n)+", prose, re.MULTILINE)  # blank lines join
  blocks += ["\n".join(line[4:] for line in block.splitlines()) for block in indented]
  found = []
  for block in blocks:
    variables = {}
    for line in _shell_lines(block):
      if assignment := re.fullmatch(r"(\w+)=(\S+)", line):
        variables[assignment.group(1)] = assignment.group(2)
      elif command := _command(line, variables):
        found.append(command)
  for span in re.findall(r"`([^`]+)`", prose):
    if command := _command(" ".join(span.split()), {}):
      found.append(command)
  return found


def _load(program: str):
  """The module of `program` ("train.py", "benchmarks.op.bench"), imported as a module: its
  `if __name__ == "__main__"` part does not run."""
  # pylint: disable=g-import-not-at-top
  import importlib
  import importlib.util
  # pylint: enable=g-import-not-at-top
  if program.endswith(".py"):
    spec = importlib.util.spec_from_file_location(pathlib.Path(program).stem, REPO / program)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
  return importlib.import_module(program + ".__main__" if program == "palimpsa_jax.conversion"
                                 else program)


class _Parsed(Exception):
  """Raised by argparse's parse_args once it accepted the arguments, so nothing runs."""


def _parse(program: str, module, argv: list[str]) -> None:
  """Parses argv as `program` does: absl flags (train.py: with its config file and overrides),
  or argparse's, through the program's main up to the parse."""
  # pylint: disable=g-import-not-at-top
  import inspect
  from absl import flags
  # pylint: enable=g-import-not-at-top
  sys.argv = [program, *argv]
  if program in ABSL:
    flags.FLAGS.unparse_flags()
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:  # an earlier parse's
      delattr(flags.FLAGS, name)  # overrides, which ml_collections defines while parsing
    (module.config_overrides.parse_flags if program == "train.py" else flags.FLAGS)(sys.argv)
  elif inspect.signature(module.main).parameters:
    module.main(argv)
  else:
    module.main()  # reads sys.argv


def _parse_all(commands: list[tuple[str, list[str]]]) -> list[str]:
  """Parses each (program, argv) in this process: "" when accepted, else why not."""
  # pylint: disable=g-import-not-at-top
  import argparse
  from palimpsa_jax import user_errors
  # pylint: enable=g-import-not-at-top
  parse_args = argparse.ArgumentParser.parse_args

  def parse_then_stop(self, args=None, namespace=None):
    parse_args(self, args, namespace)
    raise _Parsed

  argparse.ArgumentParser.parse_args = parse_then_stop
  modules, results = {}, []
  for program, argv in commands:
    try:
      if program not in modules:
        modules[program] = _load(program)
      _parse(program, modules[program], argv)
      results.append("")
    except _Parsed:
      results.append("")
    except FileNotFoundError as missing:  # an input of the user's (runs/x), not an argument
      results.append("" if "configs/" not in str(missing) else user_errors.message(missing))
    except SystemExit as exit_:  # argparse's refusal (its message went to stderr)
      results.append(f"exit {exit_.code}")
    except Exception as error:  # pylint: disable=broad-exception-caught
      results.append(f"{type(error).__name__}: {user_errors.message(error)}")
  return results


def _groups() -> dict[str, list[tuple[str, str, list[str]]]]:
  """{group: [(page, program, argv), ...]} over PAGES: each absl program alone (their flags
  live in one registry per process), the argparse ones together."""
  groups = collections.defaultdict(list)
  for page in PAGES:
    for program, argv in documented_commands(page):
      groups[program if program in ABSL else "argparse programs"].append((page, program, argv))
  return groups


def test_the_pages_give_commands_of_every_kind():
  groups = _groups()
  assert set(ABSL) - {"palimpsa_jax.conversion.torch_models"} <= set(groups)
  assert any(program == "benchmarks.mqar.sweep" for _, program, _ in groups["argparse programs"])
  conversion = [argv for page, _, argv in groups["train.py"]
                if page == "docs/results/conversion.md"]
  assert len(conversion) == 4  # the pretraining and the three fine-tunings, $MQ resolved
  assert all("$MQ" not in " ".join(argv) for argv in conversion)


@pytest.mark.parametrize("group", sorted(_groups()))
def test_documented_commands_parse(group):
  import importlib.util  # pylint: disable=g-import-not-at-top
  commands = [(page, program, argv) for page, program, argv in _groups()[group]
              if program != "palimpsa_jax.evaluation.commonsense"
              or importlib.util.find_spec("lm_eval")]  # the eval extra
  script = ("import json, sys\nfrom tests.test_documented_commands import _parse_all\n"
            "print(json.dumps(_parse_all(json.loads(sys.stdin.read()))))\n")
  done = subprocess.run([sys.executable, "-c", script],
                        input=json.dumps([(program, argv) for _, program, argv in commands]),
                        capture_output=True, text=True, cwd=REPO, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads(done.stdout.strip().splitlines()[-1])
  refused = [f"{page}: {program} {shlex.join(argv)}\n  -> {result}"
             for (page, program, argv), result in zip(commands, results) if result]
  assert not refused, "documented commands that do not parse:\n" + "\n".join(refused)


def _lm_model_config(arg: str):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("lm_config", REPO / "configs" / "lm.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg).model


def test_quoted_parameter_counts_are_the_models():
  """docs/training.md's `--dry_run   # params: N` and docs/mesanet.md's 170m table."""
  from palimpsa_jax import models  # pylint: disable=g-import-not-at-top
  quoted = [("docs/training.md", arg, int(count)) for arg, count in re.findall(
      r"configs/lm\.py:(\S+) --dry_run\s+# params: (\d+)", (REPO / "docs/training.md").read_text())]
  quoted += [("docs/mesanet.md", f"model={model},size=170m", int(count.replace(",", "")))
             for model, count in re.findall(r"^\| (\w+) \| ([\d,]+) \|$",
                                            (REPO / "docs/mesanet.md").read_text(), re.MULTILINE)]
  assert len(quoted) == 4
  wrong = [f"{page}: {arg} quoted {count:,}, counted {counted:,}" for page, arg, count in quoted
           if (counted := models.abstract_parameter_count(_lm_model_config(arg),
                                                          models.build_model)) != count]
  assert not wrong, "\n".join(wrong)

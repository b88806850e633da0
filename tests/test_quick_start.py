"""The README's first commands: finding Python 3.12, CI running them, TensorBoard's install."""

import pathlib
import re
import subprocess
import tomllib

REPO = pathlib.Path(__file__).parents[1]


def _executable(path: pathlib.Path, text: str) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  path.chmod(0o755)


def _find(env: dict) -> subprocess.CompletedProcess:
  return subprocess.run(["/bin/bash", str(REPO / "scripts" / "python312")], env=env,
                        capture_output=True, text=True, check=False)


def test_python312_finder_uses_a_pyenv_install_that_is_not_the_global_version(tmp_path):
  # pyenv's shim fails while 3.12 is not the global version; python3 on PATH is another version.
  _executable(tmp_path / "shims" / "python3.12",
              "#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
  _executable(tmp_path / "shims" / "python3", "#!/bin/sh\nexit 1\n")
  env = {"PATH": str(tmp_path / "shims"), "HOME": str(tmp_path),
         "PYENV_ROOT": str(tmp_path / "pyenv")}
  result = _find(env)
  assert result.returncode == 1 and "no Python 3.12 found" in result.stderr
  installed = tmp_path / "pyenv" / "versions" / "3.12.7" / "bin" / "python3.12"
  _executable(installed, "#!/bin/sh\nexit 0\n")  # Answers the version check with "3.12".
  result = _find(env)
  assert result.returncode == 0 and result.stdout.strip() == str(installed)


def _bash_blocks(markdown: str) -> list[str]:
  return re.findall(r"```bash\n(.*?)```", markdown, re.DOTALL)


def test_readme_commands_find_python312_and_ci_runs_the_test_command():
  readme = (REPO / "README.md").read_text()
  first, tests = _bash_blocks(readme)[:2]
  for block in (first, tests):
    assert block.startswith('"$(scripts/python312)" -m venv .venv && ')
  ci = (REPO / ".ci" / "run").read_text()
  assert "$(scripts/python312)" in ci
  # CI's commands are the README's test command, step by step (CI's pip is quiet).
  install, run = tests.strip().split(" && ")[-2:]
  assert install in ci.replace("python -m pip install -q", "pip install")
  assert ci.rstrip().endswith(run)


def test_later_readme_commands_run_the_environments_programs_from_any_shell():
  # Only the first two blocks activate .venv; the others must not need that shell.
  readme = (REPO / "README.md").read_text()
  for block in _bash_blocks(readme)[2:]:
    for command in re.split(r"&&|\n", block.replace("\\\n", " ")):
      if command.strip():
        assert command.split()[0].startswith(".venv/bin/"), command
  assert not re.findall(r"`((?:python|pip|tensorboard) [^`]*)`", readme)


def test_tensorboard_command_follows_its_documented_install():
  extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
      "optional-dependencies"]
  assert re.fullmatch(r"tensorboard==\d+\.\d+\.\d+", " ".join(extras["tensorboard"]))
  readme = (REPO / "README.md").read_text()
  install = readme.index("pip install -e '.[tensorboard]'")
  assert install < readme.index("tensorboard --logdir", install)

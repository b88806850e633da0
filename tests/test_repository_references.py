"""The repository cites only what it contains: no outside notes, no tracker issue numbers."""

import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).parents[1]
# Notes kept outside the repository, and issue numbers of a tracker a reader cannot see.
OUTSIDE = re.compile(r"\b(SPEC|PERF|DESIGN)\.md\b|/work/" + r"shared\b|\bissues? #?\d|\bissue-\d",
                     re.IGNORECASE)


def _tracked_files() -> list[str]:
  try:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
  except (OSError, subprocess.CalledProcessError):
    pytest.skip("not a git checkout")
  return [name for name in listed.stdout.decode().split("\0") if name]


def test_no_tracked_file_cites_outside_notes_or_issue_numbers():
  found = []
  for name in _tracked_files():
    try:
      text = (REPO / name).read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
      continue  # Binary files, and files deleted in the working tree.
    for number, line in enumerate(text.splitlines(), 1):
      if OUTSIDE.search(line):
        found.append(f"{name}:{number}: {line.strip()[:120]}")
  assert not found, "point these to docs/ instead:\n" + "\n".join(found)


def test_the_archived_notebook_is_checked():
  assert "docs/archive/RESULTS.md" in _tracked_files()

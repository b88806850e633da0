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


# A Markdown link's target, and a docs page or README named in prose or code.
LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)#\s]+)")
NAMED_PAGE = re.compile(r"(?<![\w/.])((?:docs/[\w./-]+|README)\.md)\b")


def test_every_link_and_named_page_exists():
  """Markdown links (relative to their page) and docs pages named anywhere resolve to files
  of the checkout; benchmark records keep the paths of their day and are left out."""
  tracked = _tracked_files()
  missing = []
  for name in tracked:
    if name.startswith("benchmarks/records/") or not name.endswith((".md", ".py")):
      continue
    text = (REPO / name).read_text(encoding="utf-8")
    targets = [(REPO / name).parent / link for link in LINK.findall(text)] if name.endswith(
        ".md") else []
    targets += [REPO / page for page in NAMED_PAGE.findall(text)]
    missing += [f"{name}: {t.relative_to(REPO) if t.is_relative_to(REPO) else t}"
                for t in targets if not t.resolve().exists()]
  assert not missing, "links to nothing:\n" + "\n".join(sorted(set(missing)))

"""One JSON record per measured run, written by the benchmark scripts to benchmarks/records/.

A record holds what a reader needs to trust and repeat a figure:

    {"benchmark": "train_throughput", "title": "...", "date": "2026-12-01 06:18 UTC",
     "device": "NVIDIA H200", "num_devices": 1, "backend": "gpu",
     "versions": {"jax": "0.11.2"}, "git_ref": "c88a775" or null,
     "command": "python -m benchmarks.NAME ...", "settings": {...}, "notes": ["..."],
     "table": {"columns": ["model", ...], "rows": [["palimpsa_d", ...], ...]} or null,
     "figures": {"name": value, ...} or null}

`table` holds the script's printed table cell by cell, as text; `figures` named values of a
run without a table. `settings` are the run's parameters that say which measurement it is
(size, batch, shapes, ...): benchmarks/render_records.py selects records by benchmark and
settings and, for each row it shows, takes the newest record that has it. Every benchmark
takes add_record_flags' two flags: `--records DIR` (default benchmarks/records/) and
`--no_record`.
"""

import argparse
import datetime
import json
import os
import pathlib
import re
import shlex
import subprocess
from typing import Any, Sequence

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDS = pathlib.Path(__file__).with_name("records")


def command_line(module: str, argv: Sequence[str], python: str = "python") -> str:
  """The shell command that reruns the benchmark module (its dotted path) with `argv`, as a
  record stores it."""
  return shlex.join([python, "-m", module, *argv])


def _int_at_least(text: str, low: int, what: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
  if value < low:
    raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
  return value


def positive_int(text: str) -> int:
  """argparse type for counts >= 1 (argparse's error names the flag)."""
  return _int_at_least(text, 1, "positive")


def non_negative_int(text: str) -> int:
  """argparse type for counts >= 0."""
  return _int_at_least(text, 0, ">= 0")


def positive_ints(text: str) -> list[int]:
  """argparse type: comma-separated integers >= 1."""
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, got {text!r}")
  return values


def add_record_flags(parser: argparse.ArgumentParser) -> None:
  """--records DIR (where the run's record goes) and --no_record: every benchmark's two flags."""
  parser.add_argument("--records", default=str(RECORDS),
                      help="folder the run's JSON record is written to (default %(default)s)")
  parser.add_argument("--no_record", action="store_true", help="write no record")


def utc_now() -> str:
  """The current time as records date it: 'YYYY-MM-DD HH:MM UTC'."""
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def git_ref() -> str:
  """The short commit of the working tree (+ "changes" when it has some), or "unknown".

  $PALIMPSA_GIT_REF, where set, is taken instead: for a copy of the tree whose .git is not the
  tree's own (the GPU machine's copy keeps the .git of an earlier commit).
  """
  if os.environ.get("PALIMPSA_GIT_REF"):
    return os.environ["PALIMPSA_GIT_REF"]
  try:
    ref = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return ref + (" + changes" if dirty else "")


def parse_table(markdown: str) -> dict[str, list]:
  """{"columns", "rows"} of a markdown table ('| a | b |' lines; the '|---|' line skipped)."""
  lines = [line.strip() for line in markdown.strip().splitlines() if line.strip()]
  cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines
           if line.startswith("|") and not set(line) <= set("|-: ")]
  if not cells:
    raise ValueError(f"no markdown table in {markdown[:80]!r}")
  columns, rows = cells[0], cells[1:]
  for row in rows:
    if len(row) != len(columns):
      raise ValueError(f"table row {row} has {len(row)} cells, the header {len(columns)}")
  return {"columns": columns, "rows": rows}


def make_record(benchmark: str, title: str, command: str, *, settings: dict[str, Any],
                notes: list[str] = (), table: str | None = None,
                figures: dict[str, Any] | None = None, date: str | None = None,
                device: str | None = None, num_devices: int | None = None,
                backend: str | None = None,
                versions: dict[str, str] | None = None) -> dict[str, Any]:
  """A record of a run (see the module docstring); `table` is the markdown table the script
  printed. Device and backend default to this process's (which starts JAX's backend: a
  process that leaves the accelerator to its children passes them); `versions` are added to
  this process's JAX version (a "jax" entry replaces it)."""
  if table is None and figures is None:
    raise ValueError("a record needs a table or figures")
  if device is None or num_devices is None or backend is None:
    devices = jax.devices()
    device, num_devices = device or devices[0].device_kind, num_devices or len(devices)
    backend = backend or jax.default_backend()
  return {"benchmark": benchmark, "title": title, "date": date or utc_now(), "device": device,
          "num_devices": num_devices, "backend": backend,
          "versions": {"jax": jax.__version__, **(versions or {})}, "git_ref": git_ref(),
          "command": command, "settings": settings, "notes": list(notes),
          "table": None if table is None else parse_table(table), "figures": figures}


def write_record(record: dict[str, Any], directory: pathlib.Path | str = RECORDS,
                 replace: pathlib.Path | None = None) -> pathlib.Path:
  """Writes the record as DIRECTORY/BENCHMARK_YYYY-MM-DDTHHMM[_N].json (a new file, never
  over an older one); returns its path. `replace`: the path this run's earlier, partial
  record was written to, rewritten in place instead (a long run keeps what it measured)."""
  if replace is not None:
    replace.write_text(_dumps(record))
    return replace
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  stamp = record["date"].removesuffix(" UTC").replace(" ", "T").replace(":", "")
  stem = f"{record['benchmark']}_{stamp}"
  path, n = directory / f"{stem}.json", 1
  while path.exists():
    n += 1
    path = directory / f"{stem}_{n}.json"
  path.write_text(_dumps(record))
  return path


# A JSON list of short scalars (a table's columns or row), as indent=1 spreads it over lines.
_SHORT_LIST = re.compile(r'\[\n(?:[ ]+(?:"(?:[^"\\\n]|\\.){0,40}"|[-+.\deE]+|true|false|null),?\n)+[ ]*\]')


def _dumps(record: dict[str, Any]) -> str:
  """Indented JSON with each table row (a list of short cells) on one line."""
  text = json.dumps(record, indent=1, ensure_ascii=False)
  return _SHORT_LIST.sub(lambda m: json.dumps(json.loads(m.group()), ensure_ascii=False),
                         text) + "\n"


def load_records(directory: pathlib.Path | str = RECORDS) -> list[dict[str, Any]]:
  """Every record under directory, its subfolders included (a GPU round's folder), oldest
  first (by date, then file name)."""
  paths = sorted(pathlib.Path(directory).rglob("*.json"))
  records = [json.loads(path.read_text()) for path in paths]
  return sorted(records, key=lambda r: r["date"])

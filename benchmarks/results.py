"""Sections appended to benchmarks/RESULTS.md by the benchmark scripts."""

import datetime
import pathlib

import jax

RESULTS = pathlib.Path(__file__).with_name("RESULTS.md")
_HEADER = "# Benchmark results\n\nAppended by the scripts in benchmarks/.\n"


def utc_now() -> str:
  """The current time as RESULTS.md dates it: 'YYYY-MM-DD HH:MM UTC'."""
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def device_line(device_kind: str, extra: str = "") -> str:
  """'- device: KIND (backend), jax VERSION[, extra]'."""
  return (f"- device: {device_kind} ({jax.default_backend()}), jax {jax.__version__}"
          + (f", {extra}" if extra else ""))


def append_section(title: str, lines: list[str], table: str,
                   path: pathlib.Path = RESULTS) -> pathlib.Path:
  """Appends '## title' with `lines` (each a full line, e.g. '- command: ...') and the
  table to path, creating the file with its header if it is missing; returns path."""
  if not path.exists():
    path.write_text(_HEADER)
  with path.open("a") as f:
    f.write(f"\n## {title}\n\n" + "".join(line + "\n" for line in lines) + f"\n{table}\n")
  return path

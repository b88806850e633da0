"""Renders the current figures from benchmarks/records/ into the docs, between marker comments.

    python -m benchmarks.render_records            # rewrite the tables in README.md and docs/
    python -m benchmarks.render_records --check    # exit 1 if a doc differs from its records

A doc holds a rendered table as

    <!-- records:NAME -->
    ...
    <!-- /records -->

where NAME is one of VIEWS. Each view selects records by benchmark and settings and, for every
row it shows (a model, a shape, ...), takes that row from the newest record that has it, so a
new run of a benchmark replaces exactly the rows it measured. Every row says when it was
measured; the record behind it has the device, versions, git ref and command.
"""

import argparse
import pathlib
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

from benchmarks import results as results_lib
from palimpsa_jax.models import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- records:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /records -->)",
                   re.DOTALL)
Record = dict[str, Any]
Row = dict[str, str]


def rows_of(record: Record) -> list[Row]:
  """The record's table rows as {column: cell}."""
  table = record.get("table") or {"columns": [], "rows": []}
  return [dict(zip(table["columns"], row)) for row in table["rows"]]


def cell(row: Row, *columns: str) -> str:
  """The first of `columns` the row has (tables renamed columns over time), else '-'."""
  return next((row[c] for c in columns if c in row), "-")


def newest_rows(records: Iterable[Record], benchmark: str,
                key: Callable[[Record, Row], tuple],
                where: Callable[[Record, Row], bool] = lambda record, row: True,
                ) -> dict[tuple, tuple[Record, Row]]:
  """{key(record, row): (record, row)} over the benchmark's rows that pass `where`, each key's
  row taken from the newest record that has it; keys in the order they were first measured."""
  chosen = {}
  for record in sorted(records, key=lambda r: r["date"]):
    if record["benchmark"] != benchmark:
      continue
    for row in rows_of(record):
      if where(record, row):
        chosen[key(record, row)] = (record, row)
  return chosen


def newest(records: Iterable[Record], benchmark: str) -> Record:
  candidates = [r for r in records if r["benchmark"] == benchmark]
  if not candidates:
    raise ValueError(f"no record of benchmark {benchmark!r}")
  return max(candidates, key=lambda r: r["date"])


def markdown(columns: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def day(record: Record) -> str:
  """'2026-12-01 06:18' (the record's date without ' UTC')."""
  return record["date"].removesuffix(" UTC")


def day_on(record: Record) -> str:
  """'2026-12-01 06:18, H200': the record's date and the short name of its device."""
  return f"{day(record)}, {record['device'].removeprefix('NVIDIA ').split()[0]}"


def _ms_pair(text: str) -> tuple[float, float]:
  """'6.76 / 30.9' -> (6.76, 30.9)."""
  forward, both = (float(part.split()[0]) for part in text.split("/"))
  return forward, both


def op_bench_kernel(records: list[Record]) -> str:
  """The GPU kernel's op time per shape against the authors' kernel and the chunked XLA path,
  on the H200 that timed the authors' kernel."""
  perf = lambda record, row: (record["settings"].get("shapes") == "perf"
                              and record["settings"].get("dtype") == "bfloat16"
                              and record["backend"] == "gpu" and "H200" in record["device"])
  times = newest_rows(records, "op_bench", lambda record, row: (
      row["shape"], row["implementation"], row["mode"]), perf)
  authors = {row["shape"].split()[0]: _ms_pair(row["authors' Triton chunk kernel fwd / fwd+bwd"])
             for row in rows_of(newest(records, "reference_timings"))}
  out = []
  for shape in authors:
    if (shape, "pallas_gpu", "fwd+bwd") not in times:
      continue
    line, dates = [shape, times[shape, "pallas_gpu", "fwd"][1]["(B, T, H, K, V)"]], set()
    for index, mode in enumerate(("fwd", "fwd+bwd")):
      record, row = times[shape, "pallas_gpu", mode]
      ms = cell(row, "ms", "ms (median)")
      chunked = times.get((shape, "chunked", mode))
      line += [ms, f"{authors[shape][index] / float(ms):.1f}",
               f"{float(cell(chunked[1], 'ms', 'ms (median)')) / float(ms):.1f}"
               if chunked else "-"]
      dates |= {day(record)} | ({day(chunked[0])} if chunked else set())
    out.append(line + [cell(row, "temp MiB"), ", ".join(sorted(dates))])
  return markdown(["shape", "(B, T, H, K, V)", "fwd ms", "x authors", "x chunked XLA",
                   "fwd+bwd ms", "x authors", "x chunked XLA", "fwd+bwd temp MiB", "measured"],
                  out)


def reference_timings(records: list[Record]) -> str:
  """The reference kernels' timings, as recorded."""
  record = newest(records, "reference_timings")
  return markdown(record["table"]["columns"], record["table"]["rows"])


# train_throughput's step time of queued steps; older records timed every step synced.
_QUEUED = "step ms (queued)"


def _throughput(records: list[Record], sizes: tuple[str, ...]) -> str:
  """One-device training throughput: per model, implementation, layer layout, remat and batch,
  the newest measurement."""
  one_device = lambda record, row: (
      record["settings"].get("size") in sizes and record["num_devices"] == 1
      and not record["settings"].get("context_parallel")
      and row.get("implementation", "auto") in ("auto", "chunked"))
  key = lambda record, row: (
      sizes.index(record["settings"]["size"]), record["settings"]["batch_size"],
      record["settings"]["seq_len"], row["scanned"],
      row["remat"] not in ("off", "no") if "remat" in row
      else bool(record["settings"].get("remat")),
      row["model"], row.get("implementation", "auto"))
  chosen = newest_rows(records, "train_throughput", key, one_device)
  out = []
  for (_, batch, seq_len, scanned, remat, model, implementation), (record, row) in sorted(
      chosen.items(), key=lambda item: item[0][:5]):
    out.append([record["settings"]["size"], model, implementation,
                "scanned" if scanned == "yes" else "unrolled", "yes" if remat else "no",
                f"{batch} x {seq_len}",
                _short_error(cell(row, _QUEUED, "step ms (median)", "step ms")),
                "queued" if _QUEUED in row else "synced",
                cell(row, "tokens/s"), cell(row, "x Mamba2 step time", "x Mamba2 step"),
                cell(row, "compile s"), cell(row, "temp GiB"), cell(row, "peak GiB"),
                day_on(record)])
  return markdown(["size", "model", "implementation", "layers", "remat", "tokens per step",
                   "step ms", "steps timed", "tokens/s", "x Mamba2 step (same call)", "compile s",
                   "temp GiB", "peak GiB", "measured"], out)


def _short_error(text: str) -> str:
  """An out of memory cell as train_throughput writes it now: 'out of memory (allocating X)'."""
  size = re.search(r"^out of memory: .*allocate ([\d.]+ ?[KMGT]i?B)", text)
  return f"out of memory (allocating {size.group(1)})" if size else text


def train_throughput_170m(records: list[Record]) -> str:
  return _throughput(records, ("170m",))


def train_throughput_large(records: list[Record]) -> str:
  return _throughput(records, ("760m", "2.7b"))


def startup(records: list[Record]) -> str:
  """train.py from command to first step, cold and warm compilation cache."""
  out = []
  for benchmark, layers, trace in (("lm_workflow", "unrolled", "lower_s"),
                                   ("train_startup", "scanned", "trace_s")):
    record = newest(records, benchmark)
    figures = record["figures"]
    for start in ("cold", "warm"):
      out.append([f"{record['settings']['model']} {record['settings']['size']}", layers,
                  start, f"{figures[f'{start}_{trace}']:g}", f"{figures[f'{start}_compile_s']:g}",
                  f"{figures[f'{start}_time_to_first_step_s']:g}", benchmark, day(record)])
  return markdown(["model", "layers", "cache", "trace and lower s", "compile s",
                   "command to first step s", "record", "measured"], out)


def _lr(text: str) -> str:
  """'0.00215' -> '2.15e-3'."""
  mantissa, exponent = f"{float(text):e}".split("e")
  return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def mqar_paper(records: list[Record]) -> str:
  """The MQAR sweep in the paper's schedule (60 epochs of 100,000 examples): per mixer and
  setting, each learning rate's best test accuracy (mean over seeds; the best rate in bold)."""
  paper = lambda record, row: (row["epochs"], row["examples"]) == ("60", "100000")
  chosen = newest_rows(records, "mqar_sweep", lambda record, row: (
      row["mixer"], int(row["seq_len"]), int(row["kv"]), float(row["lr"]), row["seed"]), paper)
  lrs = sorted({key[3] for key in chosen})
  cells: dict[tuple, list[tuple[Record, Row]]] = {}
  for key, found in chosen.items():
    cells.setdefault(key[:3], []).append(found)
  rank = {mixer: index for index, mixer in enumerate(registry.MIXERS)}  # registry's, then others
  out = []
  for (mixer, seq_len, kv), found in sorted(cells.items(), key=lambda item: (
      item[0][1], rank.get(item[0][0], len(rank)), item[0][0], item[0][2])):
    by_lr: dict[float, list[Row]] = {}
    for _, row in found:
      by_lr.setdefault(float(row["lr"]), []).append(row)
    means = {lr: sum(_percent(row) for row in rows) / len(rows) for lr, rows in by_lr.items()}
    texts = []
    for lr in lrs:
      rows = by_lr.get(lr)
      if not rows:
        texts.append("-")
        continue
      text = f"{means[lr]:.2f}%"
      text = f"**{text}**" if means[lr] == max(means.values()) else text
      texts.append(text + (f" (step {int(rows[0]['at step']):,})"
                           if len(rows) == 1 and rows[0]["at step"] != "-" else
                           f" ({len(rows)} seeds)" if len(rows) > 1 else ""))
    steps = dict.fromkeys(f"{int(row['steps done']):,}" for lr in lrs for row in by_lr.get(lr, []))
    finished = sum(row["finished"] != "no" for _, row in found)
    out.append([registry.label(mixer), f"{seq_len}, {kv}", *texts, " / ".join(steps),
                f"{finished} of {len(found)}",
                ", ".join(sorted({day(record) for record, _ in found}))])
  return markdown(["mixer", "L, kv pairs", *(f"lr {_lr(str(lr))}" for lr in lrs), "steps done",
                   "runs finished", "measured"], out)


def _percent(row: Row) -> float:
  """A run's best accuracy in % (0 for a run not evaluated yet)."""
  return 0.0 if row["best accuracy"] == "n/a" else float(row["best accuracy"].rstrip("%"))


def torch_interop(records: list[Record]) -> str:
  """The newest PyTorch interop record: its table, versions, command and notes."""
  record = newest(records, "torch_interop")
  versions = ", ".join(f"{name} {version}" for name, version in record["versions"].items())
  settings = record["settings"]
  return (markdown(record["table"]["columns"], record["table"]["rows"])
          + f"\n\n(measured {day(record)} UTC on {record['device']}, {versions}; batch "
          f"{settings['batch']} x {settings['seq_len']} tokens: `{record['command']}`)\n\n"
          + "\n".join(f"- {note}" for note in record["notes"]))


def activation_bytes(records: list[Record]) -> str:
  """Bytes a block keeps per token and layer at 8 x 4096 tokens: each (model, size, precision)
  from the newest activation_bytes record that has it."""
  chosen = newest_rows(
      records, "activation_bytes", key=lambda r, row: (row["model"], row["size"],
                                                       row["precision"]),
      where=lambda r, row: (r["settings"]["batch"], r["settings"]["seq_len"]) == (8, 4096))
  columns = list(rows_of(next(iter(chosen.values()))[0])[0])
  rows = [[row[c] for c in columns] + [day(record)] for record, row in chosen.values()]
  return markdown(columns + ["measured"], rows)


def _as_recorded(benchmark: str) -> Callable[[list[Record]], str]:
  def view(records: list[Record]) -> str:
    record = newest(records, benchmark)
    return (markdown(record["table"]["columns"], record["table"]["rows"])
            + f"\n\n(measured {day(record)} UTC on {record['device']}: `{record['command']}`)")
  view.__doc__ = f"The newest {benchmark} record's table, as recorded."
  return view


VIEWS: dict[str, Callable[[list[Record]], str]] = {
    "op_bench_kernel": op_bench_kernel,
    "reference_timings": reference_timings,
    "train_throughput_170m": train_throughput_170m,
    "train_throughput_large": train_throughput_large,
    "startup": startup,
    "context_parallel_ab": _as_recorded("context_parallel_ab"),
    "decode_bench": _as_recorded("decode_bench"),
    "mqar_paper": mqar_paper,
    "mqar_batched_throughput": _as_recorded("mqar_batched_throughput"),
    "torch_interop": torch_interop,
    "activation_bytes": activation_bytes,
}


def render_text(text: str, records: list[Record]) -> str:
  """The text with every records block re-rendered."""
  def replace(match: re.Match) -> str:
    name = match["name"]
    if name not in VIEWS:
      raise ValueError(f"unknown records view {name!r}; known: {', '.join(VIEWS)}")
    return f"{match.group(1)}{VIEWS[name](records)}\n{match.group(4)}"
  return BLOCK.sub(replace, text)


def documents(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
  """README.md and the docs pages."""
  return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n")[0])
  parser.add_argument("--check", action="store_true",
                      help="change nothing; exit 1 if a document differs from its records")
  parser.add_argument("--records", default=str(results_lib.RECORDS), help="records folder")
  args = parser.parse_args(argv)
  records = results_lib.load_records(args.records)
  stale = []
  for path in documents():
    text = path.read_text()
    rendered = render_text(text, records)
    if rendered != text:
      stale.append(path.relative_to(ROOT))
      if not args.check:
        path.write_text(rendered)
  for path in stale:
    print(f"{'out of date' if args.check else 'rendered'}: {path}")
  return 1 if args.check and stale else 0


if __name__ == "__main__":
  sys.exit(main())

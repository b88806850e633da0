"""One command for a GPU round: the project's GPU measurements in one call, records in one folder.

    python -m benchmarks.gpu_round                        # one GPU, within --budget_s (9 minutes)
    python -m benchmarks.gpu_round --skip_tests --out /tmp/round
    python -m benchmarks.gpu_round --tiny --skip_tests    # CPU: every part at tiny shapes

The parts, in order, each a child process (`python -m ...`) whose record goes to --out:
  tests       the compiled GPU tests of the kernels (`pytest -m gpu tests/pallas_kernels`);
              --skip_tests leaves them out. Where FLA is installed, its Triton autotuning for
              the op shapes runs meanwhile (op/fla.py), so that the op bench only compiles
              the chosen configurations.
  op          op/bench.py at D760, D170, K128 and MQAR: the exact op's and Fast Palimpsa's GPU
              kernels, FLA's chunk Gated DeltaNet where FLA is installed, float64 checks on
              the first --ref_steps steps (outputs and gradients; full lengths must be finite).
  step760     Palimpsa-D 760M as configs/lm.py ships it (8 x 4096 tokens a step), exact and
              precision=rank1, one process each: tokens/s, peak GiB, compile s, or the out of
              memory line; XLA's memory-usage report of each compiled step is kept.
  profile760  the step profile's categories at 760M, 4 x 4096 tokens, scanned, no remat.
  mqar        the MQAR paper step (Palimpsa-D, (512, 128), batch 128, float32): device step ms
              and its kernel profile.
A part is given at most its cap (PARTS) and what is left of --budget_s; one that would start
with less than its minimum is skipped. Each part's output goes to PART.log in --out, and the
round's summary, printed last, also goes as its own record (gpu_round_*.json) beside the parts'.
Parts that fail or run out of time say so in the summary; the others still run.
"""

import argparse
import dataclasses
import gzip
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import results as results_lib
from palimpsa_jax.models import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
OP_SHAPES = ("D760", "D170", "K128", "MQAR")
# FLA's shapes for its autotuning (op/timing.py's SHAPES["perf"]; FLA faults at K = 16, MQAR).
FLA_SHAPES = ("D760", "D170", "K128")


@dataclasses.dataclass(frozen=True)
class Part:
  """A child command of the round."""

  name: str
  argv: tuple[str, ...]  # after `python`
  cap_s: float  # most seconds it may take
  min_s: float  # not started with less left
  env: tuple[tuple[str, str], ...] = ()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="",
                      help="folder of the round's records and logs (default "
                      "benchmarks/records/gpu_round_DATE)")
  parser.add_argument("--budget_s", type=float, default=540.0,
                      help="seconds for the whole round (default: 9 minutes)")
  parser.add_argument("--skip_tests", action="store_true",
                      help="leave out the compiled GPU tests")
  parser.add_argument("--only", nargs="*", choices=("tests", "op", "step760", "profile760",
                                                    "mqar"),
                      help="run only these parts")
  parser.add_argument("--ref_steps", type=int, default=512,
                      help="the op bench's float64 checks on the first N steps")
  parser.add_argument("--tiny", action="store_true",
                      help="every part at tiny shapes (a check of the round on a CPU)")
  return parser.parse_args(argv)


def fla_installed() -> bool:
  return all(importlib.util.find_spec(p) is not None for p in ("torch", "triton", "fla"))


def plan(args: argparse.Namespace, out: pathlib.Path, traces: pathlib.Path) -> list[Part]:
  """The round's parts in order; profiler traces go under `traces` (not kept)."""
  records = ("--records", str(out))
  fla = fla_installed() and not args.tiny
  parts = []
  if not args.skip_tests:
    # Compiles dominate the tests: many workers keep the host's cores busy (the kernels'
    # tests are small enough to share the GPU).
    workers = ["-n", "8"] if importlib.util.find_spec("xdist") else []
    parts.append(Part("tests", ("-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                                *workers, "tests/pallas_kernels"), 130, 60,
                      (("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),)))
  if args.tiny:
    op = ("--shapes", "small", "--only", "tiny", "--impls", "chunked", "fast_palimpsa",
          "--chunk-size", "16", "--iters", "2", "--warmup", "1", "--rotate", "1",
          "--ref_steps", "64")
  else:
    op = ("--shapes", "perf", "--only", *OP_SHAPES, "--impls", "pallas_gpu",
          "fast_palimpsa_gpu", "--ref_steps", str(args.ref_steps))
    if fla:
      op += ("--fla", "fla_gated_deltanet")
  parts.append(Part("op", ("-m", "benchmarks.op.bench", *op, *records), 250, 60))
  size = (("--size", "tiny", "--seq_len", "64", "--batch_size", "2") if args.tiny
          else ("--size", "760m", "--batch_size", "8"))
  steps = (("--steps", "1", "--warmup_steps", "0") if args.tiny
           else ("--steps", "5", "--warmup_steps", "2"))
  for precision in ("exact", "rank1"):
    dump = out / f"xla_{precision}"
    parts.append(Part(
        f"step760 {precision}", ("-m", "benchmarks.step.throughput", "--models", registry.DEFAULT,
                                 *size, "--as_shipped", "--precision", precision, *steps,
                                 *records), 70, 45,
        (("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
          "--xla_dump_hlo_module_re=jit_step".strip()),)))
  profile_size = (size if args.tiny else ("--size", "760m", "--batch_size", "4"))
  parts.append(Part("profile760", ("-m", "benchmarks.step.profile", *profile_size,
                                   "--scan_layers", "--steps", "1" if args.tiny else "5",
                                   "--trace_steps", "1" if args.tiny else "2",
                                   "--warmup_steps", "0" if args.tiny else "1",
                                   "--top", "30", "--trace_dir", str(traces / "step760"),
                                   *records), 50, 40))
  mqar = (("--mqar", "preset=cpu", "--steps", "2", "--trace_steps", "1") if args.tiny
          else ("--mqar", "--steps", "20", "--trace_steps", "2"))
  parts.append(Part("mqar", ("-m", "benchmarks.step.profile", *mqar, "--trace_dir",
                             str(traces / "mqar"), *records), 60, 30))
  if args.only:
    parts = [p for p in parts if p.name.split()[0] in args.only]
  return parts


@dataclasses.dataclass
class Outcome:
  """How a part ended."""

  name: str
  status: str  # "ok", "failed (exit N)", "out of time", "skipped: ..."
  seconds: float
  headline: str = ""


def run_part(part: Part, seconds: float, out: pathlib.Path, log) -> Outcome:
  """Runs one part with at most `seconds`, its output to out/NAME.log."""
  path = out / f"{part.name.replace(' ', '_')}.log"
  env = dict(os.environ, PYTHONUNBUFFERED="1", **dict(part.env))
  log(f"{part.name}: {shlex_join((sys.executable, *part.argv))} (at most {seconds:.0f} s)")
  start = time.perf_counter()
  with open(path, "w") as stream:
    process = subprocess.Popen([sys.executable, *part.argv], cwd=ROOT, env=env,
                               stdout=stream, stderr=subprocess.STDOUT, start_new_session=True)
    try:
      code = process.wait(timeout=seconds)
      status = "ok" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
      os.killpg(process.pid, 9)
      process.wait()
      status = "out of time"
  elapsed = time.perf_counter() - start
  log(f"{part.name}: {status} after {elapsed:.0f} s (log {path.name})")
  return Outcome(part.name, status, elapsed)


def shlex_join(argv) -> str:
  import shlex  # pylint: disable=import-outside-toplevel
  return shlex.join(str(a) for a in argv)


class Background:
  """FLA's Triton autotuning in a child process while the tests run (GPU kernels compile on
  the host meanwhile); the op bench's FLA rows then only compile the tuned configurations."""

  def __init__(self, out: pathlib.Path, log):
    from benchmarks.op.timing import SHAPES  # pylint: disable=import-outside-toplevel
    shapes = [",".join(map(str, SHAPES["perf"][name])) for name in FLA_SHAPES]
    self.log = log
    self.stream = open(out / "fla_autotune.log", "w")
    log("FLA autotuning in the background: " + ", ".join(FLA_SHAPES))
    self.process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.op.fla", *shapes,
         "--impls", "fla_gated_deltanet"], cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=self.stream,
        stderr=subprocess.STDOUT, start_new_session=True)

  def finish(self, seconds: float) -> None:
    """Waits at most `seconds` for the tuning, then stops it."""
    try:
      self.process.wait(timeout=max(seconds, 1))
    except subprocess.TimeoutExpired:
      os.killpg(self.process.pid, 9)
      self.process.wait()
      self.log("FLA autotuning stopped unfinished: the op bench tunes the rest itself")
    self.stream.close()


def _records(out: pathlib.Path, benchmark: str) -> list[dict[str, Any]]:
  return [r for r in results_lib.load_records(out) if r["benchmark"] == benchmark]


def _rows(record: dict[str, Any]) -> list[dict[str, str]]:
  table = record.get("table") or {"columns": [], "rows": []}
  return [dict(zip(table["columns"], row)) for row in table["rows"]]


def op_summary(out: pathlib.Path) -> str:
  """Markdown: per shape, ms forward / forward+backward of each implementation the op bench timed,
  and Fast Palimpsa's GPU kernel over FLA's Gated DeltaNet."""
  found = _records(out, "op_bench")
  if not found:
    return ""
  rows = _rows(found[-1])
  impls = list(dict.fromkeys(r["implementation"] for r in rows))
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  ms = {(r["shape"], r["implementation"], r["mode"]): r["ms"] for r in rows}
  lines = ["| shape | " + " | ".join(f"{i} fwd / fwd+bwd ms" for i in impls)
           + " | fast_palimpsa_gpu / FLA GDN, fwd+bwd |",
           "|---|" + "---|" * (len(impls) + 1)]
  for shape in shapes:
    cells = [f"{ms.get((shape, i, 'fwd'), '-')} / {ms.get((shape, i, 'fwd+bwd'), '-')}"
             for i in impls]
    ratio = "-"
    try:
      fast = float(ms[(shape, "fast_palimpsa_gpu", "fwd+bwd")])
      ratio = f"{fast / float(ms[(shape, 'fla_gated_deltanet', 'fwd+bwd')]):.2f}x"
    except (KeyError, ValueError):
      pass
    lines.append(f"| {shape} | " + " | ".join(cells) + f" | {ratio} |")
  return "\n".join(lines)


def headline(name: str, out: pathlib.Path, outcome: Outcome) -> str:
  """A part's main figures from its record or log."""
  base = name.split()[0]
  if base == "tests":
    text = (out / "tests.log").read_text(errors="replace") if (out / "tests.log").exists() else ""
    counts = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|errors?|deselected).*?)\s*=*\s*$",
                        text, re.M)
    return counts[-1] if counts else ""
  if base == "op":
    found = _records(out, "op_bench")
    if not found:
      return ""
    rows = _rows(found[-1])
    wrong = sum("WRONG" in r.get("rel. error", "") for r in rows)
    failed = sum("FAILED" in r.get("rel. error", "") for r in rows)
    partial = [n for n in found[-1]["notes"] if n.startswith("partial")]
    return (f"{len(rows)} rows, {wrong} wrong, {failed} failed"
            + (f"; {partial[0]}" if partial else ""))
  if base == "step760":
    precision = name.split()[1]
    for record in reversed(_records(out, "train_throughput")):
      if record["settings"].get("precision") == precision:
        row = _rows(record)[0]
        if row.get("tokens/s", "-") != "-":
          return (f"{row['tokens/s']} tokens/s, peak {row['peak GiB']} GiB, compile "
                  f"{row['compile s']} s, remat {row['remat']}")
        return (f"{row.get('step ms (queued)', '')}; compiled peak {row['peak GiB']} GiB, "
                f"temp {row['temp GiB']} GiB")
    return ""
  if base in ("profile760", "mqar"):
    benchmark = "step_profile" if base == "profile760" else "mqar_step_profile"
    found = _records(out, benchmark)
    if not found:
      return ""
    figures = found[-1]["figures"]
    unit = "step"
    by_category = figures.get(f"ms_per_{unit}_by_category", {})
    text = ", ".join(f"{k} {v:.1f}" for k, v in by_category.items())
    device = figures.get(f"device_ms_per_{unit}")
    lead = (f"device step {figures['device_step_ms']:.2f} ms; " if "device_step_ms" in figures
            else "")
    return lead + (f"device {device:.1f} ms: " if device else "") + text
  return ""


def keep_memory_reports(out: pathlib.Path) -> list[str]:
  """The compiled 760M steps' memory-usage reports (XLA's dump): kept as .txt.gz beside the
  records, the rest of the dump removed. Returns the kept files' names."""
  kept = []
  for dump in sorted(out.glob("xla_*")):
    if not dump.is_dir():
      continue
    for report in sorted(dump.glob("*memory-usage-report.txt")):
      target = out / f"{dump.name}_{len(kept)}_memory_usage_report.txt.gz"
      with open(report, "rb") as source, gzip.open(target, "wb") as sink:
        shutil.copyfileobj(source, sink)
      kept.append(target.name)
    shutil.rmtree(dump)
  return kept


def summary_table(outcomes: list[Outcome]) -> str:
  lines = ["| part | status | seconds | figures |", "|---|---|---|---|"]
  for o in outcomes:
    lines.append(f"| {o.name} | {o.status} | {o.seconds:.0f} | "
                 f"{o.headline.replace('|', '/') or '-'} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  date = results_lib.utc_now()
  out = pathlib.Path(args.out or results_lib.RECORDS / (
      "gpu_round_" + date.removesuffix(" UTC").replace(" ", "T").replace(":", "")))
  out.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  log = lambda msg: print(f"[{time.perf_counter() - start:6.0f} s] {msg}", file=sys.stderr,
                          flush=True)
  traces = pathlib.Path(tempfile.mkdtemp(prefix="gpu_round_traces_"))
  parts = plan(args, out, traces)
  background = None
  names = [p.name for p in parts]
  if fla_installed() and not args.tiny and "op" in names and "tests" in names:
    background = Background(out, log)
  outcomes = []
  for part in parts:
    if part.name == "op" and background is not None:
      background.finish(min(120.0, args.budget_s - (time.perf_counter() - start) - part.min_s))
      background = None
    left = args.budget_s - (time.perf_counter() - start)
    if left < part.min_s:
      outcomes.append(Outcome(part.name, f"skipped: {left:.0f} s left of the budget", 0.0))
      log(f"{part.name}: skipped ({left:.0f} s left)")
      continue
    outcome = run_part(part, min(part.cap_s, left), out, log)
    outcome.headline = headline(part.name, out, outcome)
    outcomes.append(outcome)
  if background is not None:
    background.finish(0)
  shutil.rmtree(traces, ignore_errors=True)
  reports = keep_memory_reports(out)
  table = summary_table(outcomes)
  ops = op_summary(out)
  print(f"\n{table}" + (f"\n\n{ops}" if ops else ""), flush=True)
  command = results_lib.command_line("benchmarks.gpu_round", sys.argv[1:] if argv is None else argv)
  record = results_lib.make_record(
      "gpu_round", "gpu_round: kernels' GPU tests, op, 760M step and profile, MQAR step",
      command, date=date, table=table, settings={"tiny": args.tiny,
                                                  "skip_tests": args.skip_tests},
      figures={"op_summary": ops, "memory_usage_reports": reports,
               "total_s": time.perf_counter() - start},
      notes=[f"budget {args.budget_s:.0f} s; each part's record lies beside this one, its "
             "output in PART.log"])
  path = results_lib.write_record(record, out)
  log(f"wrote {path}")
  return {"outcomes": [dataclasses.asdict(o) for o in outcomes], "out": str(out),
          "record": str(path)}


if __name__ == "__main__":
  main()

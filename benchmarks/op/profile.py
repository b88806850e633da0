"""Where one Palimpsa op call's time goes: per-kernel times from a profiler trace, or one
stage of the palimpsa_gpu kernel under Nsight Compute.

    python -m benchmarks.op.profile --shape D170                    # pallas_gpu, fwd and fwd+bwd
    python -m benchmarks.op.profile --shape MQAR --modes fwd --top 10 --output mqar.json
    python -m benchmarks.op.profile --shapes small --shape tiny --impl chunked   # CPU check
    python -m benchmarks.op.profile --shape D760 --ncu walk_bwd     # GPU with ncu
    python -m benchmarks.op.profile --shape D170 --ncu walk_fwd --keep /tmp/prof
    python -m benchmarks.op.profile --shape D760 --ncu walk_fwd --device "NVIDIA H100" \\
        --from_report /tmp/prof/details.txt /tmp/prof/source.csv      # an exported report

The trace (default) compiles the op's forward (out, final state) or forward+backward (loss
and the gradients of the six inputs) for one shape on bf16 inputs, runs --warmup calls, then
traces --calls calls queued back to back with jax.profiler. Each kernel's time per call is
listed with its category, its HLO shape and the line of this project's code that launched it
(benchmarks/step/profile.py does the attribution). "device time" in the header is the sum of
kernel times per call; the wall time per call beside it includes the gaps between kernels and
the profiler's overhead. --output writes JSON; each mode's table and times go as a record
(benchmark "op_profile") to --records (benchmarks/records/).

--ncu STAGE runs that stage of the palimpsa_gpu kernel alone (benchmarks/op/stages.py: the
op's inputs and tiles, bf16 rows) under `ncu` for one launch of its Mosaic GPU kernel, with
the clocks left alone (--clock-control none), then summarizes the report in three tables:
- the launch: duration, registers, shared memory, occupancy, warps per scheduler, IPC and
  issue-slot use;
- the executed instructions per state entry and step (per thread: warp instructions x 32
  / (B H T V K)) by opcode, and the most executed block of code (the walk's loop body);
- the shares of the warps' stall reasons (sampled warp states).
The backward walk is profiled with partial sums (accumulate=False): ncu 2025.3 crashed
(segmentation fault) profiling the whole op's forward and backward, whose backward walk
adds its sums by TMA reduce-add; the walk alone with partial sums profiled cleanly.
The tables and the exported report's numbers go as a record (benchmark "kernel_profile").
"""

import argparse
import collections
import csv
import dataclasses
import io
import json
import math
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import results as results_lib
from benchmarks.op import stages, timing
from benchmarks.results import non_negative_int, positive_int
from benchmarks.step import profile as step_profile
from pallas_kernels.palimpsa_gpu import make_config
from palimpsa_jax.ops.palimpsa import validation

MODES = ("fwd", "fwd+bwd")
# The stages' Mosaic GPU kernels (Mosaic appends "_mosaic_gpu_kernel" to the name).
KERNELS = {"boundary": "palimpsa_boundary_mosaic", "walk_fwd": "palimpsa_walk_forward_mosaic",
           "walk_bwd": "palimpsa_walk_backward_mosaic"}
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "SchedulerStats", "WarpStateStats",
            "InstructionStats", "LaunchStats", "Occupancy", "SourceCounters")
# The launch table's metrics (ncu's names on the details page) and their labels.
LAUNCH_METRICS = (
    ("Duration", "duration"), ("Registers Per Thread", "registers per thread"),
    ("Dynamic Shared Memory Per Block", "dynamic shared memory per CTA"),
    ("Block Limit Registers", "CTAs per SM allowed by registers"),
    ("Block Limit Shared Mem", "CTAs per SM allowed by shared memory"),
    ("Achieved Occupancy", "achieved occupancy"),
    ("Active Warps Per Scheduler", "active warps per scheduler"),
    ("Eligible Warps Per Scheduler", "eligible warps per scheduler"),
    ("Executed Ipc Active", "IPC (of 4)"), ("Issue Slots Busy", "issue slots busy"),
    ("Executed Instructions", "executed warp instructions"))
TOP_OPCODES = 14
_DETAIL_LINE = re.compile(
    r"^\s+(?P<name>\S.*?)\s{2,}(?:(?P<unit>\S+)\s+)?(?P<value>-?[\d,]*\.?\d+)\s*$")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", choices=sorted(timing.SHAPES), default="perf",
                      help="the shape set (benchmarks/op/timing.py) --shape is taken from")
  parser.add_argument("--shape", default="D170", help="a shape name of that set")
  trace = parser.add_argument_group("the trace (default)")
  trace.add_argument("--impl", default="pallas_gpu")
  trace.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
  trace.add_argument("--chunk-size", type=positive_int, default=64)
  trace.add_argument("--calls", type=positive_int, default=5, help="traced calls")
  trace.add_argument("--warmup", type=non_negative_int, default=3)
  trace.add_argument("--top", type=positive_int, default=25, help="kernels listed per table")
  trace.add_argument("--trace_dir", default="/tmp/palimpsa_op_profile")
  trace.add_argument("--output", default="", help="JSON file for the results")
  ncu = parser.add_argument_group("Nsight Compute")
  ncu.add_argument("--ncu", choices=sorted(KERNELS), metavar="STAGE",
                   help=f"profile this stage of palimpsa_gpu ({', '.join(KERNELS)}) with ncu "
                        "instead of tracing the op")
  ncu.add_argument("--keep", default="", help="folder for ncu's report and its pages "
                   "(default: a temporary one)")
  ncu.add_argument("--from_report", nargs=2, metavar=("DETAILS", "SOURCE_CSV"),
                   help="summarize these exported pages instead of running ncu")
  ncu.add_argument("--device", default="", help="with --from_report: the GPU the report was "
                   "taken on, for the record")
  ncu.add_argument("--note", default="", help="a line recorded with the results (with "
                   "--from_report: how the report was taken)")
  ncu.add_argument("--run_stage", action="store_true", help=argparse.SUPPRESS)
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)
  if args.shape not in timing.SHAPES[args.shapes]:
    parser.error(f"--shape must be one of {sorted(timing.SHAPES[args.shapes])} "
                 f"(--shapes {args.shapes}), got {args.shape!r}")
  if args.impl not in validation.IMPLEMENTATIONS:
    parser.error(f"--impl must be one of {validation.IMPLEMENTATIONS}, got {args.impl!r}")
  ncu_only = [flag for flag, value in (("--keep", args.keep), ("--from_report", args.from_report),
                                      ("--device", args.device), ("--note", args.note))
              if value]
  if ncu_only and not args.ncu:
    parser.error(f"{', '.join(ncu_only)}: only with --ncu STAGE")
  if args.from_report and not args.device:
    parser.error("--from_report needs --device (the GPU the report was taken on)")
  return args


def trace(args: argparse.Namespace, command: str) -> dict[str, Any]:
  """Traces the op's calls per mode; prints and records each mode's kernel table."""
  shape = timing.SHAPES[args.shapes][args.shape]
  inputs = timing.make_inputs(0, shape, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(1), shape[:3] + (shape[4],), jnp.float32)
  device = jax.devices()[0]
  result = {"shape": args.shape, "dims": shape, "implementation": args.impl,
            "device": device.device_kind, "jax": jax.__version__, "command": command,
            "modes": {}}
  for mode in args.modes:
    if mode == "fwd":
      call_args = inputs
      fn = timing.fwd_fn(args.impl, args.chunk_size, variance=False)
    else:
      call_args = (inputs, cot)
      fn = timing.fwd_bwd_fn(args.impl, args.chunk_size)
    compiled = fn.lower(*call_args).compile()
    for _ in range(args.warmup):
      jax.block_until_ready(compiled(*call_args))
    rows, wall_ms, _ = step_profile.trace_calls(
        lambda: compiled(*call_args), compiled, args.calls,
        f"{args.trace_dir}/{mode.replace('+', '_')}")
    table = step_profile.format_table(rows, args.top, wall_ms, unit="call")
    print(f"### {args.shape} {shape} {args.impl} {mode}, {device.device_kind}, "
          f"jax {jax.__version__}\n\n{table}\n", flush=True)
    result["modes"][mode] = {"wall_ms": wall_ms,
                             "kernels": [dataclasses.asdict(r) for r in rows]}
    if not args.no_record:
      record = step_profile.profile_record(
          "op_profile", f"op_profile {args.shape} {args.impl} {mode}", command,
          rows=rows, top=args.top, wall_ms=wall_ms, unit="call",
          settings={"shapes": args.shapes, "shape": args.shape, "implementation": args.impl,
                    "mode": mode, "chunk_size": args.chunk_size, "dtype": "bfloat16"})
      print(f"wrote {results_lib.write_record(record, args.records)}", file=sys.stderr)
  if args.output:
    pathlib.Path(args.output).write_text(json.dumps(result, indent=2))
  return result


def parse_details(text: str) -> dict[str, tuple[float, str]]:
  """{metric name: (value, unit)} of an ncu details page (`ncu --import R --page
  details`, one kernel); the first of repeated names is kept."""
  metrics = {}
  for line in text.splitlines():
    match = _DETAIL_LINE.match(line)
    if match and match["name"] not in metrics:
      metrics[match["name"]] = (float(match["value"].replace(",", "")), match["unit"] or "")
  return metrics


@dataclasses.dataclass
class SourceCounts:
  """Per-opcode executed warp instructions, stall samples by reason and the hottest block
  (static instructions executed the same number of times, most executions in all)."""
  opcodes: collections.Counter
  stalls: collections.Counter
  hot_block_size: int
  hot_block_runs: int


def parse_source(text: str) -> SourceCounts:
  """The SASS source page of one kernel exported as CSV (`ncu --import R --page source
  --csv --print-source sass`): a "Kernel Name" line, then a header with "Source",
  "Instructions Executed" and the "stall_<reason>" sample columns, one row per
  instruction."""
  lines = text.splitlines()
  start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
  if start is None:
    raise ValueError("not an ncu source page: no header line starting with \"Address\"")
  reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
  stall_columns = [c for c in reader.fieldnames or ()
                   if c.startswith("stall_") and "Not Issued" not in c]
  opcodes, stalls, by_runs = collections.Counter(), collections.Counter(), collections.Counter()
  for row in reader:
    words = row["Source"].split()
    if not words:
      continue
    opcode = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    runs = int(row["Instructions Executed"].replace(",", "") or 0)
    opcodes[opcode.split(".")[0]] += runs
    by_runs[runs] += 1
    for column in stall_columns:
      stalls[column.removeprefix("stall_")] += int(row[column] or 0)
  runs = max(by_runs, key=lambda r: r * by_runs[r], default=0)
  return SourceCounts(opcodes, stalls, by_runs[runs], runs)


def summary_tables(details: dict, source: SourceCounts, shape) -> tuple[str, str, str]:
  """The launch, instructions-per-entry-step and stall tables (markdown)."""
  entry_steps = math.prod(shape) / 32  # Warp-wide entry-steps: per thread, x 32 / elements.
  launch = ["| launch | value |", "|---|---|"]
  for name, label in LAUNCH_METRICS:
    if name in details:
      value, unit = details[name]
      shown = f"{value:,.0f}" if value.is_integer() else f"{value:,.4g}"
      launch.append(f"| {label} | {shown}{' ' + unit if unit else ''} |")
  total = sum(source.opcodes.values())
  ops = ["| opcode | per entry and step | share |", "|---|---|---|"]
  top = source.opcodes.most_common(TOP_OPCODES)
  ops += [f"| {opcode} | {n / entry_steps:.2f} | {n / total:.1%} |" for opcode, n in top]
  rest = total - sum(n for _, n in top)
  ops += [f"| other | {rest / entry_steps:.2f} | {rest / total:.1%} |",
          f"| all | {total / entry_steps:.2f} | 100% |",
          f"| hottest block: {source.hot_block_size} instructions, each run "
          f"{source.hot_block_runs:,} times | "
          f"{source.hot_block_size * source.hot_block_runs / entry_steps:.2f} | "
          f"{source.hot_block_size * source.hot_block_runs / total:.1%} |"]
  samples = sum(source.stalls.values())
  stalls = ["| warp state | share of samples |", "|---|---|"]
  stalls += [f"| {reason} | {n / samples:.1%} |"
             for reason, n in source.stalls.most_common() if n]
  return tuple("\n".join(t) for t in (launch, ops, stalls))


def run_stage(stage: str, shape, calls: int) -> None:
  """Runs one stage of the kernel alone `calls` times (the process ncu profiles)."""
  args, _ = stages.kernel_inputs(0, shape)
  cfg = make_config(args[0], args[2], args[4], args[5], return_variance=False,
                    chunk_size=64, interpret=False)
  backend = getattr(cfg, stages.OP_STAGES[stage]).backend
  if backend != "mosaic":
    raise SystemExit(f"--ncu {stage}: this GPU runs it with {backend}, not Mosaic GPU "
                     "(--ncu profiles the Mosaic kernels, sm_90)")
  cfg = dataclasses.replace(cfg, accumulate_bwd=False)
  fn = stages.stage_fn(stage, cfg)
  stage_args = stages.stage_args(cfg, args)[stages.STAGES.index(stage)]
  for _ in range(calls):
    jax.block_until_ready(fn(*stage_args))


def run_ncu(args: argparse.Namespace, folder: pathlib.Path) -> tuple[str, str]:
  """(details page, source page CSV) of one launch of the stage's kernel under ncu."""
  ncu = shutil.which("ncu")
  if ncu is None:
    raise SystemExit("--ncu needs Nsight Compute's `ncu` on PATH (a GPU machine); "
                     "or summarize an exported report with --from_report")
  report = folder / "report"
  sections = [f for s in SECTIONS for f in ("--section", s)]
  child = [sys.executable, "-m", "benchmarks.op.profile", "--shapes", args.shapes, "--shape",
           args.shape, "--ncu", args.ncu, "--run_stage"]
  subprocess.run([ncu, "--clock-control", "none", "--kernel-name",
                  f"regex:^{KERNELS[args.ncu]}", "--launch-count", "1", *sections,
                  "--import-source", "no", "-f", "-o", str(report), *child], check=True)
  pages = []
  for page, extra in (("details", []), ("source", ["--csv", "--print-source", "sass"])):
    pages.append(subprocess.run([ncu, "--import", f"{report}.ncu-rep", "--page", page, *extra],
                                check=True, capture_output=True, text=True).stdout)
  (folder / "details.txt").write_text(pages[0])
  (folder / "source.csv").write_text(pages[1])
  return pages[0], pages[1]


def ncu_summary(args: argparse.Namespace, command: str) -> None:
  """Profiles the stage under ncu (or reads --from_report); prints and records the tables."""
  shape = timing.SHAPES[args.shapes][args.shape]
  if args.from_report:
    details, source = (pathlib.Path(p).read_text() for p in args.from_report)
  else:
    with tempfile.TemporaryDirectory() as tmp:
      folder = pathlib.Path(args.keep or tmp)
      folder.mkdir(parents=True, exist_ok=True)
      details, source = run_ncu(args, folder)
  launch, opcodes, stalls = summary_tables(parse_details(details), parse_source(source), shape)
  title = f"{KERNELS[args.ncu]} at {args.shape} {shape}, bf16 rows"
  print(f"### {title}\n\n{launch}\n\n{opcodes}\n\n{stalls}")
  if not args.no_record:
    record = results_lib.make_record(
        "kernel_profile", f"kernel_profile: {title}", command,
        settings={"shape": args.shape, "stage": args.ncu},
        table=opcodes, backend="gpu", device=args.device or None,
        notes=["ncu --clock-control none, one launch; per entry and step = executed warp "
               "instructions x 32 / (B H T V K)", "launch:\n" + launch, "stalls:\n" + stalls]
        + ([args.note] if args.note else []))
    print(f"wrote {results_lib.write_record(record, args.records)}")


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  command = results_lib.command_line("benchmarks.op.profile", argv)
  if args.run_stage:  # The child that ncu profiles.
    run_stage(args.ncu, timing.SHAPES[args.shapes][args.shape], calls=2)
    return None
  if args.ncu:
    ncu_summary(args, command)
    return None
  return trace(args, command)


if __name__ == "__main__":
  main()

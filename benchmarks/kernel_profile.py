"""Nsight Compute profile of one stage of the palimpsa_gpu kernel, per state entry and step.

    python3 -m benchmarks.kernel_profile --shape D760 --stage walk_bwd        # GPU with ncu
    python3 -m benchmarks.kernel_profile --shape D170 --stage walk_fwd --keep /tmp/prof
    python3 -m benchmarks.kernel_profile --shape D760 --stage walk_fwd \\
        --from_report /tmp/prof/details.txt /tmp/prof/source.csv      # an exported report

Runs the stage alone (benchmarks/gpu_kernel_bench.py's inputs and tiles, bf16 rows) under
`ncu` for one launch of its Mosaic GPU kernel, with the clocks left alone
(--clock-control none), then summarizes the report in three tables:
- the launch: duration, registers, shared memory, occupancy, warps per scheduler, IPC and
  issue-slot use;
- the executed instructions per state entry and step (per thread: warp instructions x 32
  / (B H T V K)) by opcode, and the most executed block of code (the walk's loop body);
- the shares of the warps' stall reasons (sampled warp states).
The backward walk is profiled with partial sums (accumulate=False): ncu 2025.3 crashed
(segmentation fault) profiling the whole op's forward and backward, whose backward walk
adds its sums by TMA reduce-add; the walk alone with partial sums profiled cleanly.
The tables and the exported report's numbers go as a record to --records.
"""

import argparse
import collections
import csv
import dataclasses
import io
import math
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

from benchmarks import results as results_lib
from benchmarks.op.timing import SHAPES

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
  """Runs one stage of the kernel `calls` times as gpu_kernel_bench times it (for ncu)."""
  import jax  # pylint: disable=import-outside-toplevel
  from benchmarks import gpu_kernel_bench  # pylint: disable=import-outside-toplevel
  from pallas_kernels.palimpsa_gpu import make_config  # pylint: disable=import-outside-toplevel
  args, _ = gpu_kernel_bench.kernel_inputs(0, shape)
  cfg = make_config(args[0], args[2], args[4], args[5], return_variance=False,
                    chunk_size=64, interpret=False)
  chosen = {"boundary": cfg.boundary_fwd, "walk_fwd": cfg.walk_fwd, "walk_bwd": cfg.walk_bwd}
  if chosen[stage].backend != "mosaic":
    raise SystemExit(f"--stage {stage}: this GPU runs it with Triton, not Mosaic GPU "
                     "(kernel_profile profiles the Mosaic kernels, sm_90)")
  cfg = dataclasses.replace(cfg, accumulate_bwd=False)
  fn = gpu_kernel_bench._stage_fn(stage, cfg)  # pylint: disable=protected-access
  stage_args = gpu_kernel_bench._stage_args(cfg, args)[  # pylint: disable=protected-access
      gpu_kernel_bench.STAGES.index(stage)]
  for _ in range(calls):
    jax.block_until_ready(fn(*stage_args))


def profile(stage: str, shape_name: str, folder: pathlib.Path) -> tuple[str, str]:
  """(details page, source page CSV) of one launch of the stage's kernel under ncu."""
  ncu = shutil.which("ncu")
  if ncu is None:
    raise SystemExit("kernel_profile needs Nsight Compute's `ncu` on PATH (a GPU machine); "
                     "or summarize an exported report with --from_report")
  report = folder / "report"
  sections = [f for s in SECTIONS for f in ("--section", s)]
  child = [sys.executable, "-m", "benchmarks.kernel_profile", "--shape", shape_name,
           "--stage", stage, "--run_stage"]
  subprocess.run([ncu, "--clock-control", "none", "--kernel-name",
                  f"regex:^{KERNELS[stage]}", "--launch-count", "1", *sections,
                  "--import-source", "no", "-f", "-o", str(report), *child], check=True)
  pages = []
  for page, extra in (("details", []), ("source", ["--csv", "--print-source", "sass"])):
    pages.append(subprocess.run([ncu, "--import", f"{report}.ncu-rep", "--page", page, *extra],
                                check=True, capture_output=True, text=True).stdout)
  (folder / "details.txt").write_text(pages[0])
  (folder / "source.csv").write_text(pages[1])
  return pages[0], pages[1]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shape", default="D760", choices=sorted(SHAPES["perf"]),
                      help="an op_bench perf shape")
  parser.add_argument("--stage", default="walk_bwd", choices=sorted(KERNELS))
  parser.add_argument("--keep", default="", help="folder for ncu's report and its pages "
                      "(default: a temporary one)")
  parser.add_argument("--from_report", nargs=2, metavar=("DETAILS", "SOURCE_CSV"),
                      help="summarize these exported pages instead of running ncu")
  parser.add_argument("--device", default="", help="with --from_report: the GPU the report "
                      "was taken on, for the record")
  parser.add_argument("--note", default="", help="a line recorded with the results (with "
                      "--from_report: how the report was taken)")
  parser.add_argument("--run_stage", action="store_true", help=argparse.SUPPRESS)
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)
  if args.from_report and not args.device:
    parser.error("--from_report needs --device (the GPU the report was taken on)")
  shape = SHAPES["perf"][args.shape]
  if args.run_stage:  # The child that ncu profiles.
    run_stage(args.stage, shape, calls=2)
    return
  if args.from_report:
    details, source = (pathlib.Path(p).read_text() for p in args.from_report)
  else:
    with tempfile.TemporaryDirectory() as tmp:
      folder = pathlib.Path(args.keep or tmp)
      folder.mkdir(parents=True, exist_ok=True)
      details, source = profile(args.stage, args.shape, folder)
  launch, opcodes, stalls = summary_tables(parse_details(details), parse_source(source), shape)
  title = f"{KERNELS[args.stage]} at {args.shape} {shape}, bf16 rows"
  print(f"### {title}\n\n{launch}\n\n{opcodes}\n\n{stalls}")
  if not args.no_record:
    record = results_lib.make_record(
        "kernel_profile", f"kernel_profile: {title}",
        results_lib.command_line("benchmarks.kernel_profile", argv or sys.argv[1:]),
        settings={"shape": args.shape, "stage": args.stage},
        table=opcodes, backend="gpu", device=args.device or None,
        notes=["ncu --clock-control none, one launch; per entry and step = executed warp "
               "instructions x 32 / (B H T V K)", "launch:\n" + launch, "stalls:\n" + stalls]
        + ([args.note] if args.note else []))
    print(f"wrote {results_lib.write_record(record, args.records)}")


if __name__ == "__main__":
  main()

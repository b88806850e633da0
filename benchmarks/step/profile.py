"""Where a training step's device time goes: per-kernel times from a profiler trace.

    python -m benchmarks.step.profile                          # Palimpsa-D 170m, 4 x 4096 tokens
    python -m benchmarks.step.profile --models mamba2 --top 30 --output mamba2_profile.json

Builds and compiles the train step of benchmarks/train_throughput.py (same flags), runs
--warmup_steps steps, then traces --steps steps with jax.profiler (a perfetto trace under
--trace_dir). Every device kernel (GPU) or XLA operation (CPU) is summed over the traced
steps and divided by their number. Each one is matched, by name, to the instruction of the
compiled step's optimized HLO that launched it, which gives its shape, its JAX operation
and the innermost line of this project's code that produced it. Pallas kernels are found
by the name their custom call carries; library GEMMs (cuBLAS) have no HLO name of their
own. The table lists the largest entries and the total per category; --output writes JSON,
and the table with the times per category goes as a record to --records (benchmarks/records/).
"""

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import pathlib
import re
import sys
import time
from typing import Any, Callable

import jax

from benchmarks import results as results_lib
from benchmarks import train_throughput
from benchmarks.train_throughput import non_negative_int, positive_int
from palimpsa_jax.models import registry

CATEGORIES = ("Pallas kernel", "GEMM", "XLA fusion", "copy / memset", "other")
_CONTROL_FLOW = ("while", "conditional", "call")
_LIBRARY_GEMM = re.compile(r"gemm|nvjet|xmma|cutlass|cublas", re.I)
_MOSAIC_GPU_SUFFIX = "_mosaic_gpu_kernel"  # Mosaic GPU names a kernel NAME_mosaic_gpu_kernel.


@dataclasses.dataclass
class KernelTime:
  """One kernel's time per step and what launched it."""

  name: str
  ms_per_step: float
  calls_per_step: float
  category: str
  shape: str = ""
  op: str = ""
  source: str = ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", dest="model", default=registry.DEFAULT,
                      help="the model (one name of the registry)")
  parser.add_argument("--size", default="170m", choices=train_throughput.models.config.SIZES)
  parser.add_argument("--seq_len", type=positive_int, default=4096)
  parser.add_argument("--batch_size", type=positive_int, default=4,
                      help="global batch in sequences")
  parser.add_argument("--implementation", default="auto")
  parser.add_argument("--scan_layers", action="store_true")
  parser.add_argument("--remat", action="store_true")
  parser.add_argument("--steps", type=positive_int, default=3, help="traced steps")
  parser.add_argument("--warmup_steps", type=non_negative_int, default=2)
  parser.add_argument("--top", type=positive_int, default=40, help="kernels listed in the table")
  parser.add_argument("--trace_dir", default="/tmp/palimpsa_step_profile")
  parser.add_argument("--output", default="", help="JSON file for the results")
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)
  if args.model not in train_throughput.models.config.MODELS:
    parser.error(f"--models takes one model, one of {train_throughput.models.config.MODELS}, "
                 f"got {args.model!r}")
  if args.implementation not in train_throughput.palimpsa_validation.IMPLEMENTATIONS:
    parser.error(f"--implementation must be one of "
                 f"{train_throughput.palimpsa_validation.IMPLEMENTATIONS}, "
                 f"got {args.implementation!r}")
  return args


def _sections(hlo: str) -> dict[str, dict[str, str]]:
  """The FileNames / FunctionNames / FileLocations / StackFrames tables of an HLO text."""
  tables = {}
  for title in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
    match = re.search(title + r"\n(.*?)\n\n", hlo, re.S)
    lines = match.group(1).splitlines() if match else []
    tables[title] = dict(line.split(" ", 1) for line in lines if " " in line)
  return tables


def _source_line(frame_id: str, tables: dict[str, dict[str, str]], project: str) -> str:
  """The innermost stack frame in this project: 'path/file.py:line (function)'."""
  frames, locations = tables["StackFrames"], tables["FileLocations"]
  seen = set()
  while frame_id in frames and frame_id not in seen:
    seen.add(frame_id)
    frame = frames[frame_id]
    location = locations.get(re.search(r"file_location_id=(\d+)", frame).group(1), "")
    match = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", location)
    if match:
      path = tables["FileNames"].get(match.group(1), "").strip('"')
      if project in path and "site-packages" not in path:
        function = tables["FunctionNames"].get(match.group(2), "").strip('"')
        return f"{path.split(project, 1)[1].lstrip('/')}:{match.group(3)} ({function})"
    frame_id = re.search(r"parent_frame_id=(\d+)", frame).group(1)
  return ""


def _key(name: str) -> str:
  """An HLO instruction name as a kernel is named ('.' and '-' become '_')."""
  return re.sub(r"[.\-]", "_", name)


def _opcode(line: str) -> tuple[str, str]:
  """(shape, opcode) of an HLO instruction line (the part after 'name = ')."""
  # The opcode is the first lower-case word followed by '(' (shapes, tuples included,
  # hold none).
  head = re.search(r"(?<![\w\[])([a-z][a-z\-]*)\(", line)
  return (line[:head.start()].strip(), head.group(1)) if head else ("", "")


@dataclasses.dataclass
class Hlo:
  """An optimized HLO text, indexed once."""

  instructions: dict[str, str]  # _key(name) -> the line after 'name = '
  custom_calls: list[str]  # the custom-call lines, for Pallas kernel names
  tables: dict[str, dict[str, str]]

  @classmethod
  def parse(cls, text: str) -> "Hlo":
    instructions = {}
    for match in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", text, re.M):
      instructions.setdefault(_key(match.group(1)), match.group(2))
    custom_calls = [line for line in instructions.values()
                    if _opcode(line)[1] == "custom-call"]
    return cls(instructions, custom_calls, _sections(text))


def attribute(name: str, hlo: Hlo, project: str):
  """(category, shape, JAX op, source line) of a kernel named `name`."""
  line = hlo.instructions.get(_key(name))
  category = "XLA fusion"
  if line is None:  # A Pallas custom call carries its kernel's name in its config.
    named = re.compile(r'\bname\s*[=:]\s*\\?"' + re.escape(name) + r'\\?"')
    line = next((l for l in hlo.custom_calls if named.search(l)), None)
    category = "Pallas kernel"
  if line is None and name.endswith(_MOSAIC_GPU_SUFFIX):
    # A Mosaic GPU kernel's call carries no name in the HLO; the kernel is named after it.
    return "Pallas kernel", "", "", ""
  if line is None:
    low = name.lower()
    if "memcpy" in low or "memset" in low:
      return "copy / memset", "", "", ""
    return ("GEMM" if _LIBRARY_GEMM.search(name) else "other"), "", "", ""
  shape, opcode = _opcode(line)
  if category != "Pallas kernel":
    if opcode == "dot" or "gemm" in name or "__cublas" in line:
      category = "GEMM"
    elif opcode in ("copy", "copy-start", "transpose"):
      category = "copy / memset"
    elif opcode != "fusion":
      category = "other"
  op = re.search(r'op_name="([^"]*)"', line)
  frame = re.search(r"stack_frame_id=(\d+)", line)
  return (category, shape[:60], op.group(1) if op else "",
          _source_line(frame.group(1), hlo.tables, project) if frame else "")


def kernel_times(trace_events: list[dict], hlo_text: str, module: str, steps: int,
                 project: str) -> list[KernelTime]:
  """Per-step time of each kernel in a trace, largest first.

  GPU kernels are the complete events on "/device:GPU" processes; on CPU, the XLA
  operations of `module` that are not control flow (a while loop's time is its body's).
  """
  processes = {e["pid"]: e["args"]["name"] for e in trace_events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
  hlo = Hlo.parse(hlo_text)
  gpu = any("GPU" in name for name in processes.values())
  totals = collections.defaultdict(lambda: [0, 0.0])
  for event in trace_events:
    if event.get("ph") != "X":
      continue
    args = event.get("args", {})
    if gpu:
      if "GPU" not in processes.get(event["pid"], ""):
        continue
      name = event["name"]
    else:
      if args.get("hlo_module") != module or "hlo_op" not in args:
        continue
      name = args["hlo_op"]
      if _opcode(hlo.instructions.get(_key(name), ""))[1] in _CONTROL_FLOW:
        continue
    totals[name][0] += 1
    totals[name][1] += event.get("dur", 0.0)
  rows = []
  for name, (count, micros) in totals.items():
    category, shape, op, source = attribute(name, hlo, project)
    rows.append(KernelTime(name, micros / 1e3 / steps, count / steps, category, shape, op,
                           source))
  return sorted(rows, key=lambda r: -r.ms_per_step)


def read_trace(trace_dir: str) -> list[dict]:
  """Events of the newest perfetto trace under trace_dir."""
  paths = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True),
                 key=lambda p: pathlib.Path(p).stat().st_mtime)
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
  events = json.load(gzip.open(paths[-1]))
  return events["traceEvents"] if isinstance(events, dict) else events


def trace_calls(run: Callable[[], Any], compiled: Any, calls: int,
                trace_dir: str) -> tuple[list[KernelTime], float, Any]:
  """Traces `calls` runs of `run` (each one call of `compiled`, queued back to back).

  Returns each kernel's time per call (largest first), the wall milliseconds per call
  and the last call's output.
  """
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  start = time.perf_counter()
  out = None
  for _ in range(calls):
    out = run()
  jax.block_until_ready(out)
  wall_ms = 1e3 * (time.perf_counter() - start) / calls
  jax.profiler.stop_trace()
  hlo = compiled.as_text()
  module = re.match(r"HloModule (\S+?),", hlo).group(1)
  project = str(pathlib.Path(__file__).resolve().parents[2])  # the repository
  return kernel_times(read_trace(trace_dir), hlo, module, calls, project), wall_ms, out


def category_ms(rows: list[KernelTime]) -> dict[str, float]:
  """Milliseconds per step (or call) of each category that has kernels, in CATEGORIES order."""
  by_category = collections.Counter()
  for r in rows:
    by_category[r.category] += r.ms_per_step
  return {category: by_category[category] for category in CATEGORIES if by_category[category]}


def kernel_table(rows: list[KernelTime], top: int, unit: str = "step") -> str:
  """Markdown: the `top` kernels, times per `unit`."""
  total = sum(r.ms_per_step for r in rows)
  lines = [f"| kernel | ms per {unit} | share | launches per {unit} | category | shape | "
           "JAX op | source |", "|---|---|---|---|---|---|---|---|"]
  for r in rows[:top]:
    lines.append(f"| {r.name[:60]} | {r.ms_per_step:.3f} | {r.ms_per_step / total:.1%} | "
                 f"{r.calls_per_step:g} | {r.category} | {r.shape} | {r.op[-60:]} | "
                 f"{r.source} |")
  return "\n".join(lines)


def format_table(rows: list[KernelTime], top: int, step_ms: float, unit: str = "step") -> str:
  """Markdown: totals per category, then the `top` kernels; times are per `unit`."""
  total = sum(r.ms_per_step for r in rows)
  lines = [f"device time {total:.2f} ms per {unit} ({unit} wall time {step_ms:.2f} ms)", "",
           f"| category | ms per {unit} | share |", "|---|---|---|"]
  for category, ms in category_ms(rows).items():
    lines.append(f"| {category} | {ms:.2f} | {ms / total:.1%} |")
  return "\n".join(lines + ["", kernel_table(rows, top, unit)])


def profile_record(benchmark: str, title: str, command: str, settings: dict[str, Any],
                   rows: list[KernelTime], top: int, wall_ms: float,
                   unit: str = "step") -> dict[str, Any]:
  """A profile's record: the `top` kernels as its table, the wall and device time per `unit`
  and the time per category as its figures."""
  return results_lib.make_record(
      benchmark, title, command, settings=settings, table=kernel_table(rows, top, unit),
      figures={f"wall_ms_per_{unit}": wall_ms,
               f"device_ms_per_{unit}": sum(r.ms_per_step for r in rows),
               f"ms_per_{unit}_by_category": category_ms(rows)})


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  throughput_args = train_throughput.parse_args([
      "--size", args.size, "--seq_len", str(args.seq_len), "--batch_size",
      str(args.batch_size), "--num_devices", "1"] + (["--remat"] if args.remat else []))
  devices = jax.devices()[:1]
  where = train_throughput.placement(throughput_args, devices)
  label = f"{args.model} ({args.implementation})"
  built = train_throughput.build_train_step(args.model, args.implementation,
                                            args.scan_layers, throughput_args, where, label)
  train_throughput.log(f"{label} compiled in {built.compile_s:.1f} s; "
                       f"{args.warmup_steps} warm-up + {args.steps} traced steps ...")
  state = built.state

  def step():
    nonlocal state
    state, metrics = built.compiled(state, built.batch)
    return state, metrics

  for _ in range(args.warmup_steps):
    step()
  jax.block_until_ready(state)
  rows, step_ms, (_, metrics) = trace_calls(step, built.compiled, args.steps, args.trace_dir)
  if not jax.device_get(metrics["train/finite"]):
    raise train_throughput.trainer.NonFiniteError(f"{label}: non-finite loss or gradient")
  table = format_table(rows, args.top, step_ms)
  print(f"{label}, {devices[0].device_kind}, jax {jax.__version__}, "
        f"{args.batch_size} x {args.seq_len} tokens\n\n{table}")
  result = {"model": args.model, "implementation": args.implementation,
            "device": devices[0].device_kind, "jax": jax.__version__,
            "command": results_lib.command_line("step.profile",
                                                 sys.argv[1:] if argv is None else argv),
            "step_ms": step_ms, "kernels": [dataclasses.asdict(r) for r in rows]}
  if args.output:
    pathlib.Path(args.output).write_text(json.dumps(result, indent=2))
    train_throughput.log(f"wrote {args.output}")
  if not args.no_record:
    record = profile_record(
        "step_profile", f"step_profile {label} {args.size}, {args.batch_size} x {args.seq_len} "
        f"tokens", result["command"], rows=rows, top=args.top, wall_ms=step_ms,
        settings={"model": args.model, "implementation": args.implementation,
                  "size": args.size, "batch_size": args.batch_size, "seq_len": args.seq_len,
                  "scan_layers": args.scan_layers, "remat": args.remat})
    train_throughput.log(f"wrote {results_lib.write_record(record, args.records)}")
  return result


if __name__ == "__main__":
  main()

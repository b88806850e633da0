"""Where a training step's time goes: host batches, device step, per-kernel times from a trace.

    python -m benchmarks.step.profile                          # Palimpsa-D 170m, 4 x 4096 tokens
    python -m benchmarks.step.profile --models mamba2 --top 30 --output mamba2_profile.json
    python -m benchmarks.step.profile --mqar                   # the MQAR paper step, Palimpsa-D
    python -m benchmarks.step.profile --mqar model=mamba2,dtype=bfloat16 --runs 12
    python -m benchmarks.step.profile --mqar preset=cpu --steps 5 --trace_steps 2     # CPU

The step is a language model's train step as benchmarks/step/throughput.py builds it (its
model flags; random tokens), or with --mqar CONFIG the MQAR sweep's batched step
(palimpsa_jax/training/batched.py) for --runs runs of one configs/mqar.py config (CONFIG: its
arguments, preset=paper unless given), run i at the paper's i-th learning rate and seed i // 4.
After --warmup_steps steps it measures, per step:
  device step: the compiled step queued back to back on one batch already on the device;
  host batch (--mqar): drawing each run's batch from its MqarTask iterator and stacking them;
  loop step (--mqar): host batches and steps interleaved as the trainer's loop does, what
    training gets (near max(host, device) when the two overlap);
each over --steps steps, then traces --trace_steps device steps with jax.profiler (a perfetto
trace under --trace_dir). Every device kernel (GPU) or XLA operation (CPU) is summed over the
traced steps and divided by their number. Each one is matched, by name, to the instruction of
the compiled step's optimized HLO that launched it, which gives its shape, its JAX operation
and the innermost line of this project's code that produced it. Pallas kernels are found by
the name their custom call carries; library GEMMs (cuBLAS) have no HLO name of their own. The
tables give the time per category, per project file that launched the kernels (the token loss,
the layers, the optimizer's update, ...) and the largest kernels; --output writes JSON, and the
tables go as a record to --records (benchmarks/records/): step_profile_* for the language
model, mqar_step_profile_* for --mqar.
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
import jax.numpy as jnp
import numpy as np

from benchmarks import results as results_lib
from benchmarks.mqar import sweep as mqar_sweep
from benchmarks.results import non_negative_int, positive_int
from benchmarks.step import throughput as train_throughput
from palimpsa_jax import user_errors
from palimpsa_jax.data import tasks as tasks_lib
from palimpsa_jax.models import registry
from palimpsa_jax.training import batched

PROGRAM = "benchmarks.step.profile"
CATEGORIES = ("Pallas kernel", "GEMM", "XLA fusion", "copy / memset", "other")
_CONTROL_FLOW = ("while", "conditional", "call")
_LIBRARY_GEMM = re.compile(r"gemm|nvjet|xmma|cutlass|cublas", re.I)
_MOSAIC_GPU_SUFFIX = "_mosaic_gpu_kernel"  # Mosaic GPU names a kernel NAME_mosaic_gpu_kernel.
# Each step's own flags and their defaults (None in argparse, so that a flag given to the
# other step is seen and refused).
LM_FLAGS = {"models": registry.DEFAULT, "size": "170m", "seq_len": 4096, "batch_size": 4,
            "implementation": "auto", "scan_layers": False, "remat": False}
MQAR_FLAGS = {"runs": 1}


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


def queued_ms(fn: Callable[[], Any], calls: int) -> tuple[float, Any]:
  """Wall milliseconds per call of `fn`, `calls` calls queued back to back, and the last
  call's output."""
  start = time.perf_counter()
  out = None
  for _ in range(calls):
    out = fn()
  jax.block_until_ready(out)
  return 1e3 * (time.perf_counter() - start) / calls, out


def trace_calls(run: Callable[[], Any], compiled: Any, calls: int,
                trace_dir: str) -> tuple[list[KernelTime], float, Any]:
  """Traces `calls` runs of `run` (each one call of `compiled`, queued back to back).

  Returns each kernel's time per call (largest first), the wall milliseconds per call
  and the last call's output.
  """
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  wall_ms, out = queued_ms(run, calls)
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


def ms_by_source_file(rows: list[KernelTime]) -> dict[str, float]:
  """Milliseconds per step of the kernels launched from each project file, most first."""
  by_file = collections.Counter()
  for row in rows:
    if row.source:
      by_file[row.source.split(":", 1)[0]] += row.ms_per_step
    elif row.category == "GEMM":
      by_file["(library GEMMs)"] += row.ms_per_step
    else:
      by_file["(no project frame)"] += row.ms_per_step
  return dict(by_file.most_common())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = user_errors.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n")[0])
  parser.add_argument("--mqar", nargs="?", const="", default=None, metavar="CONFIG",
                      help="profile the MQAR sweep's step of these configs/mqar.py arguments "
                      "(preset=paper unless given) instead of a language model's")
  parser.add_argument("--steps", type=positive_int, default=30, help="timed steps per measure")
  parser.add_argument("--warmup_steps", type=non_negative_int, default=2)
  parser.add_argument("--trace_steps", type=positive_int, default=3, help="traced steps")
  parser.add_argument("--top", type=positive_int, default=30, help="kernels listed in the table")
  parser.add_argument("--trace_dir", default="/tmp/palimpsa_step_profile")
  parser.add_argument("--output", default="", help="JSON file for the results")
  results_lib.add_record_flags(parser)
  lm = parser.add_argument_group("the language model's step (without --mqar)")
  lm.add_argument("--models", help=f"the model, one of {train_throughput.models.config.MODELS} "
                  f"(default {LM_FLAGS['models']})")
  lm.add_argument("--size", choices=train_throughput.models.config.SIZES,
                  help=f"(default {LM_FLAGS['size']})")
  lm.add_argument("--seq_len", type=positive_int, help=f"(default {LM_FLAGS['seq_len']})")
  lm.add_argument("--batch_size", type=positive_int,
                  help=f"global batch in sequences (default {LM_FLAGS['batch_size']})")
  lm.add_argument("--implementation", choices=train_throughput.palimpsa_validation.IMPLEMENTATIONS,
                  help=f"(default {LM_FLAGS['implementation']})")
  lm.add_argument("--scan_layers", action="store_true", default=None)
  lm.add_argument("--remat", action="store_true", default=None)
  mqar = parser.add_argument_group("the MQAR step (with --mqar)")
  mqar.add_argument("--runs", type=positive_int, help="runs in the group (default 1)")
  args = parser.parse_args(argv)
  own, other = (MQAR_FLAGS, LM_FLAGS) if args.mqar is not None else (LM_FLAGS, MQAR_FLAGS)
  given = [f"--{name}" for name in other if getattr(args, name) is not None]
  if given:
    flags = ", ".join(given)
    parser.error(f"{flags}: for the language model's step, not --mqar's" if args.mqar is not None
                 else f"{flags}: for the MQAR step only; add --mqar")
  for name, default in own.items():
    if getattr(args, name) is None:
      setattr(args, name, default)
  if args.mqar is None and args.models not in train_throughput.models.config.MODELS:
    parser.error(f"--models takes one model, one of {train_throughput.models.config.MODELS}, "
                 f"got {args.models!r}")
  return args


@dataclasses.dataclass
class Step:
  """A compiled training step ready to run, and how to name and record it."""

  compiled: Any  # its optimized HLO names the kernels
  device_step: Callable[[], Any]  # one step on the batch on the device; returns the metrics
  loop_step: Callable[[], Any] | None  # one step on the next host batch (--mqar)
  next_host_batch: Callable[[], Any] | None
  label: str
  benchmark: str  # the record's name
  settings: dict[str, Any]
  compile_s: float


def language_model_step(args: argparse.Namespace) -> Step:
  """The train step of benchmarks/step/throughput.py for args' model, on one device."""
  throughput_args = train_throughput.parse_args([
      "--size", args.size, "--seq_len", str(args.seq_len), "--batch_size",
      str(args.batch_size), "--num_devices", "1"] + (["--remat"] if args.remat else []))
  where = train_throughput.placement(throughput_args, jax.devices()[:1])
  label = f"{args.models} ({args.implementation})"
  built = train_throughput.build_train_step(args.models, args.implementation,
                                            args.scan_layers, throughput_args, where, label)
  state = built.state

  def device_step():
    nonlocal state
    state, metrics = built.compiled(state, built.batch)
    return metrics

  return Step(built.compiled, device_step, None, None,
              f"{label} {args.size}, {args.batch_size} x {args.seq_len} tokens",
              "step_profile", {"model": args.models, "implementation": args.implementation,
                               "size": args.size, "batch_size": args.batch_size,
                               "seq_len": args.seq_len, "scan_layers": args.scan_layers,
                               "remat": args.remat}, built.compile_s)


def group_configs(config_arg: str, runs: int) -> list[Any]:
  """The configs of the group: `config_arg` (preset=paper unless given) per run."""
  base = config_arg if "preset=" in config_arg else ",".join(
      filter(None, ["preset=paper", config_arg]))
  rates = mqar_sweep.LEARNING_RATES
  return [mqar_sweep.mqar_config(
      f"{base},learning_rate={rates[i % len(rates)]},seed={i // len(rates)}")
          for i in range(runs)]


def group_model(configs: list[Any]) -> tuple[dict[int, tasks_lib.MqarTask],
                                             batched.GroupModel]:
  """The group's tasks by seed and its model (batched.GroupModel: the sweep's step)."""
  tasks = {c.seed: tasks_lib.MqarTask(c) for c in configs}
  return tasks, batched.GroupModel(configs[0], next(iter(tasks.values())).total_steps)


def mqar_step(config_arg: str, runs: int) -> Step:
  """The MQAR sweep's batched step for `runs` runs of configs/mqar.py's `config_arg`."""
  configs = group_configs(config_arg, runs)
  config, seeds = configs[0], [c.seed for c in configs]
  device = jax.local_devices()[0]
  tasks, model = group_model(configs)
  state = model.init(seeds, device)
  lrs = jnp.asarray([c.optimizer.learning_rate for c in configs], jnp.float32)
  active = jnp.ones((len(configs),), bool)
  next_host_batch = lambda: batched.next_batch(tasks, seeds)
  on_device = jax.device_put(next_host_batch(), device)
  start = time.perf_counter()
  compiled = model.train_step.lower(state, on_device, lrs, active).compile()
  compile_s = time.perf_counter() - start

  def run(batch):
    nonlocal state
    state, metrics = compiled(state, batch, lrs, active)
    return metrics

  label = (f"MQAR {config.args.model} {config.model.dtype}, L={config.seq_len} "
           f"kv={config.data.num_kv_pairs} batch {config.batch_size}, {len(configs)} runs")
  return Step(compiled, lambda: run(on_device), lambda: run(next_host_batch()),
              next_host_batch, label, "mqar_step_profile",
              {"config": config_arg, "runs": len(configs)}, compile_s)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  step = (mqar_step(args.mqar, args.runs) if args.mqar is not None
          else language_model_step(args))
  device = jax.devices()[0]
  train_throughput.log(f"{step.label} compiled in {step.compile_s:.1f} s; "
                       f"{args.warmup_steps} warm-up, {args.steps} timed and "
                       f"{args.trace_steps} traced steps ...")
  for _ in range(args.warmup_steps):
    step.device_step()
  times = {"device_step_ms": queued_ms(step.device_step, args.steps)[0]}
  if step.loop_step is not None:
    times["host_batch_ms"] = queued_ms(step.next_host_batch, args.steps)[0]
    times["loop_step_ms"] = queued_ms(step.loop_step, args.steps)[0]
  rows, traced_ms, metrics = trace_calls(step.device_step, step.compiled, args.trace_steps,
                                         args.trace_dir)
  if not np.all(jax.device_get(metrics["train/finite"])):
    raise train_throughput.trainer.NonFiniteError(f"{step.label}: non-finite loss or gradient")
  by_file = ms_by_source_file(rows)
  columns = [("host batch ms", "host_batch_ms"), ("device step ms", "device_step_ms"),
             ("loop step ms", "loop_step_ms")]
  shown = [(title, times[key]) for title, key in columns if key in times]
  if "loop_step_ms" in times:
    shown += [("loop steps/s per run", 1e3 / times["loop_step_ms"]),
              ("loop steps/s, all runs", 1e3 * args.runs / times["loop_step_ms"])]
  summary = ("| " + " | ".join(title for title, _ in shown) + " |\n|" + "---|" * len(shown)
             + "\n| " + " | ".join(f"{value:.2f}" for _, value in shown) + " |")
  files = "| launched from | ms per step |\n|---|---|\n" + "\n".join(
      f"| {name} | {ms:.3f} |" for name, ms in by_file.items())
  print(f"{step.label}, {device.device_kind}, jax {jax.__version__}; compile "
        f"{step.compile_s:.1f} s\n\n{summary}\n\n{files}\n\n"
        f"{format_table(rows, args.top, traced_ms)}", flush=True)
  command = results_lib.command_line(PROGRAM,
                                     sys.argv[1:] if argv is None else argv)
  result = {"label": step.label, **step.settings, "device": device.device_kind,
            "jax": jax.__version__, "command": command, "compile_s": step.compile_s, **times,
            "traced_step_ms": traced_ms, "ms_per_step_by_file": by_file,
            "kernels": [dataclasses.asdict(r) for r in rows]}
  if args.output:
    pathlib.Path(args.output).write_text(json.dumps(result, indent=2))
    train_throughput.log(f"wrote {args.output}")
  if not args.no_record:
    record = profile_record(step.benchmark, f"{step.benchmark} {step.label}", command,
                            step.settings, rows, args.top, traced_ms)
    record["figures"].update(times, ms_per_step_by_file=by_file)
    train_throughput.log(f"wrote {results_lib.write_record(record, args.records)}")
  return result


if __name__ == "__main__":
  user_errors.one_line(PROGRAM, main)()

"""Where an MQAR training step's time goes: host batches, device step, kernels.

    python -m benchmarks.mqar_step_profile                                   # Palimpsa-D, paper
    python -m benchmarks.mqar_step_profile --config model=mamba2,dtype=bfloat16 --runs 12
    python -m benchmarks.mqar_step_profile --config preset=cpu --steps 5 --trace_steps 2  # CPU

Builds the batched trainer's step (palimpsa_jax/training/batched.py, the step the
MQAR sweep runs) for --runs runs of one configs/mqar.py config (--config: its
arguments; preset=paper unless given), with run i at the paper's i-th learning
rate and seed i // 4, and measures, per step of the group:
  host batch: drawing each run's batch from its MqarTask iterator and stacking them;
  device step: the compiled step queued back to back on one batch already on the device;
  loop step: host batches and steps interleaved as the trainer's loop does.
The loop step is what training gets; it is near max(host, device) when the two
overlap. A profiler trace of --trace_steps device steps then lists each kernel's
time (benchmarks/step/profile.py does the attribution) and sums the kernels by the
project file that launched them (the token loss, the layers, the optimizer's update, ...;
library GEMMs name no file and count as "(library GEMMs)"). --output writes JSON;
the table goes as a record to --records (benchmarks/records/).
"""

import argparse
import collections
import dataclasses
import json
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import mqar_sweep
from benchmarks import results as results_lib
from benchmarks.step import profile as step_profile
from benchmarks.train_throughput import positive_int
from palimpsa_jax.data import tasks as tasks_lib
from palimpsa_jax.models import registry
from palimpsa_jax.training import batched


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


def ms_by_source_file(rows: list[step_profile.KernelTime]) -> dict[str, float]:
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


def per_step_ms(fn, steps: int) -> float:
  start = time.perf_counter()
  out = None
  for _ in range(steps):
    out = fn()
  jax.block_until_ready(out)
  return 1e3 * (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default=f"model={registry.DEFAULT}",
                      help="configs/mqar.py arguments (preset=paper unless given)")
  parser.add_argument("--runs", type=positive_int, default=1, help="runs in the group")
  parser.add_argument("--steps", type=positive_int, default=30, help="timed steps per measure")
  parser.add_argument("--trace_steps", type=positive_int, default=3)
  parser.add_argument("--top", type=positive_int, default=25, help="kernels listed")
  parser.add_argument("--trace_dir", default="/tmp/palimpsa_mqar_step_profile")
  parser.add_argument("--output", default="", help="JSON file for the results")
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)

  configs = group_configs(args.config, args.runs)
  config = configs[0]
  seeds = [c.seed for c in configs]
  device = jax.local_devices()[0]
  start = time.perf_counter()
  tasks, model = group_model(configs)
  data_s = time.perf_counter() - start
  state = model.init(seeds, device)
  lrs = jnp.asarray([c.optimizer.learning_rate for c in configs], jnp.float32)
  active = jnp.ones((len(configs),), bool)
  on_device = jax.device_put(batched.next_batch(tasks, seeds), device)
  start = time.perf_counter()
  compiled = model.train_step.lower(state, on_device, lrs, active).compile()
  compile_s = time.perf_counter() - start

  def device_step():
    nonlocal state
    state, metrics = compiled(state, on_device, lrs, active)
    return state, metrics

  def loop_step():
    nonlocal state
    state, metrics = compiled(state, batched.next_batch(tasks, seeds), lrs, active)
    return state, metrics

  for _ in range(3):
    device_step()
  host_ms = per_step_ms(lambda: batched.next_batch(tasks, seeds), args.steps)
  device_ms = per_step_ms(device_step, args.steps)
  loop_ms = per_step_ms(loop_step, args.steps)
  rows, traced_ms, (_, metrics) = step_profile.trace_calls(
      device_step, compiled, args.trace_steps, args.trace_dir)
  if not np.all(jax.device_get(metrics["train/finite"])):
    raise FloatingPointError("non-finite loss or gradient in the profiled steps")

  label = (f"MQAR {config.args.model} {config.model.dtype}, L={config.seq_len} "
           f"kv={config.data.num_kv_pairs} batch {config.batch_size}, {len(configs)} runs")
  summary = ("| host batch ms | device step ms | loop step ms | loop steps/s per run "
             "| loop steps/s, all runs |\n|---|---|---|---|---|\n"
             f"| {host_ms:.2f} | {device_ms:.2f} | {loop_ms:.2f} | {1e3 / loop_ms:.1f} "
             f"| {1e3 * len(configs) / loop_ms:.1f} |")
  by_file = ms_by_source_file(rows)
  files = "| launched from | ms per step |\n|---|---|\n" + "\n".join(
      f"| {name} | {ms:.3f} |" for name, ms in by_file.items())
  print(f"{label}, {device.device_kind}, jax {jax.__version__}; data {data_s:.1f} s, "
        f"compile {compile_s:.1f} s\n\n{summary}\n\n{files}\n\n"
        f"{step_profile.format_table(rows, args.top, traced_ms)}", flush=True)
  command = results_lib.command_line("mqar_step_profile",
                                     sys.argv[1:] if argv is None else argv)
  result = {"label": label, "config": args.config, "runs": len(configs),
            "device": device.device_kind, "jax": jax.__version__, "command": command,
            "host_batch_ms": host_ms, "device_step_ms": device_ms, "loop_step_ms": loop_ms,
            "compile_s": compile_s, "ms_per_step_by_file": by_file,
            "kernels": [dataclasses.asdict(r) for r in rows]}
  if args.output:
    pathlib.Path(args.output).write_text(json.dumps(result, indent=2))
  if not args.no_record:
    record = step_profile.profile_record(
        "mqar_step_profile", f"mqar_step_profile {label}", command, rows=rows, top=args.top,
        wall_ms=traced_ms, settings={"config": args.config, "runs": len(configs)})
    record["figures"].update(host_batch_ms=host_ms, device_step_ms=device_ms,
                             loop_step_ms=loop_ms, ms_per_step_by_file=by_file)
    print(f"wrote {results_lib.write_record(record, args.records)}", flush=True)
  return result


if __name__ == "__main__":
  main()

"""MQAR training steps/s: many runs batched in one process vs one run per process.

    python -m benchmarks.mqar.batched_throughput --output $OUT/mqar_batched_throughput.json

Per mixer, in the paper's MQAR setting (configs/mqar.py:preset=paper) at one
(seq_len, kv): the single-run trainer (trainer.train_and_evaluate, train.py's
loop) on one run, and the batched trainer (training/batched.py) on --runs runs
(the paper's learning rates x seeds 0, 1, 2, ...), each from scratch for a
fixed number of steps. Each measurement is a child process of its own, so that
a failure or a hang costs only that one (within the --budget_s left). The rate
is the median of the logged perf/steps_per_sec after the first log interval
(which includes compilation); the total is rate x runs. Evaluation runs only
after the last step and is not timed.

A batched measurement that runs out of GPU memory is retried with half the
runs; one that fails otherwise, with XLA's deterministic ops (which turn off
the Palimpsa kernel's accumulating backward walk) and then with the XLA
"chunked" implementation. The JSON (--output) holds every attempt; the table of
rates goes as a record to --records (benchmarks/records/).
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import results as results_lib
from benchmarks.mqar import sweep as mqar_sweep
from palimpsa_jax.models import registry

REPO = pathlib.Path(__file__).resolve().parents[2]

LEARNING_RATES = mqar_sweep.LEARNING_RATES
# Retries of a failed batched measurement: (extra XLA flag, implementation).
FALLBACKS = (("", "auto"), ("--xla_gpu_deterministic_ops=true", "auto"), ("", "chunked"))


def measurement_config(mixer: str, seq_len: int, kv: int, lr: float, seed: int,
                       impl: str, steps: int, log_every: int):
  """The paper's config, cut to `steps` steps, logged every `log_every`."""
  # Fewer examples than the paper's 100k: only data generation time changes.
  config = mqar_sweep.mqar_config(
      f"preset=paper,model={mixer},seq_len={seq_len},num_kv_pairs={kv},learning_rate={lr},"
      f"seed={seed},implementation={impl},num_train_examples=20000,num_test_examples=256")
  config.total_steps = steps
  config.log_every_steps = log_every
  config.eval_every_steps = steps
  config.checkpoint_every_steps = steps
  config.log_diagnostics = False
  return config


def child(args: argparse.Namespace) -> None:
  """One measurement; prints 'RESULT <json>'."""
  import jax  # pylint: disable=g-import-not-at-top
  from palimpsa_jax.training import batched  # pylint: disable=g-import-not-at-top
  from palimpsa_jax.training import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  from palimpsa_jax.training import trainer  # pylint: disable=g-import-not-at-top
  seq_len, kv = (int(x) for x in args.setting.split(":"))
  pairs = [(LEARNING_RATES[i % len(LEARNING_RATES)], i // len(LEARNING_RATES))
           for i in range(args.runs)]
  steps = args.steps if args.mode == "batched" else args.single_steps
  configs = [measurement_config(args.mixer, seq_len, kv, lr, seed, args.impl, steps,
                                steps // 6) for lr, seed in pairs]
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as root:
    workdirs = [f"{root}/run{i}" for i in range(len(configs))]
    if args.mode == "batched":
      batched.train_group(configs, workdirs)
    else:
      trainer.train_and_evaluate(configs[0], workdirs[0])
    rates = [r["perf/steps_per_sec"] for r in metrics_lib.read_metrics(workdirs[0])
             if "perf/steps_per_sec" in r][1:]
  rate = statistics.median(rates)
  print("RESULT " + json.dumps({
      "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
      "jax": jax.__version__,
      "steps": steps, "steps_per_sec_per_run": rate,
      "total_steps_per_sec": rate * len(configs), "logged_rates": rates,
      "wall_s": time.perf_counter() - start}), flush=True)


def measure(mode: str, mixer: str, runs: int, impl: str, xla_flag: str,
            args: argparse.Namespace, timeout_s: float) -> dict:
  """Runs one child; its result, or the error (last lines of its output)."""
  command = [sys.executable, "-m", "benchmarks.mqar.batched_throughput", "--child",
             f"--mode={mode}", f"--model={mixer}", f"--runs={runs}", f"--impl={impl}",
             f"--setting={args.setting}", f"--steps={args.steps}",
             f"--single_steps={args.single_steps}"]
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  if xla_flag:
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " " + xla_flag
  record = {"mode": mode, "mixer": mixer, "runs": runs, "impl": impl,
            "xla_flag": xla_flag, "setting": args.setting}
  print(f"== {mode} {mixer} x{runs} impl={impl} {xla_flag} (limit {timeout_s:.0f} s)",
        file=sys.stderr, flush=True)
  try:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                          cwd=REPO, env=env)
  except subprocess.TimeoutExpired:
    return {**record, "error": f"timed out after {timeout_s:.0f} s"}
  lines = done.stdout.splitlines()
  results = [line for line in lines if line.startswith("RESULT ")]
  if done.returncode or not results:
    tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
    return {**record, "error": f"exit code {done.returncode}", "output_tail": tail}
  return {**record, **json.loads(results[-1][len("RESULT "):])}


def write_record(records: list[dict], summary: dict, args: argparse.Namespace,
                 command: str) -> None:
  """The rates per mixer as a record, the failed attempts as its notes (none if nothing ran;
  device and versions from a measurement's child, as this process leaves the GPU alone)."""
  done = [r for r in records if "error" not in r]
  if not done:
    print("no measurement succeeded: no record", file=sys.stderr, flush=True)
    return
  lines = ["| mixer | batched runs | batched impl | batched total steps/s | single steps/s "
           "| speed-up |", "|---|---|---|---|---|---|"]
  for mixer, row in summary.items():
    batched = next(r for r in done if r["mixer"] == mixer and r["mode"] == "batched")
    lines.append(f"| {mixer} | {batched['runs']} | {batched['impl']} "
                 f"| {row['batched_total_steps_per_sec']:.1f} | {row['single_steps_per_sec']:.1f} "
                 f"| {row['speedup_over_one_single_process']:.2f} |")
  notes = [" ".join(filter(None, (r["mode"], r["mixer"], f"x{r['runs']}", f"impl={r['impl']}",
                                  r.get("xla_flag")))) + f": {r['error']}"
           for r in records if "error" in r]
  record = results_lib.make_record(
      "mqar_batched_throughput", f"MQAR batched vs single-run training at {args.setting}",
      command, settings={"setting": args.setting, "runs": args.runs, "steps": args.steps,
                         "single_steps": args.single_steps},
      table="\n".join(lines), device=done[0]["device"], num_devices=1,
      backend=done[0]["backend"], versions={"jax": done[0]["jax"]},
      notes=["rate: median logged steps/s per run after the first log interval; total: rate x "
             "runs"] + notes)
  print(f"wrote {results_lib.write_record(record, args.records)}", file=sys.stderr, flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n")[0])
  parser.add_argument("--output", type=pathlib.Path, default=None)
  parser.add_argument("--models", dest="mixers", default=f"{registry.BASELINE},{registry.DEFAULT}",
                      help="comma-separated mixers")
  parser.add_argument("--runs", type=int, default=12, help="runs in the batched group.")
  parser.add_argument("--setting", default="512:128", help="seq_len:kv.")
  parser.add_argument("--steps", type=int, default=150, help="steps of the batched group.")
  parser.add_argument("--single_steps", type=int, default=300,
                      help="steps of the single run.")
  parser.add_argument("--budget_s", type=float, default=330.0,
                      help="wall time for all measurements together.")
  results_lib.add_record_flags(parser)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--mode", choices=("batched", "single"), help=argparse.SUPPRESS)
  parser.add_argument("--model", dest="mixer", help=argparse.SUPPRESS)
  parser.add_argument("--impl", default="auto", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    child(args)
    return

  deadline = time.perf_counter() + args.budget_s
  records = []
  for mixer in args.mixers.split(","):
    for mode, runs in (("batched", args.runs), ("single", 1)):
      attempts = list(FALLBACKS if mode == "batched" else FALLBACKS[:1])
      while attempts:
        xla_flag, impl = attempts.pop(0)
        left = deadline - time.perf_counter()
        if left < 20:
          records.append({"mode": mode, "mixer": mixer, "runs": runs, "impl": impl,
                          "error": "skipped: out of the time budget"})
          break
        records.append(measure(mode, mixer, runs, impl, xla_flag, args, left))
        print(json.dumps(records[-1]), file=sys.stderr, flush=True)
        if "error" not in records[-1]:
          break
        if runs > 1 and "RESOURCE_EXHAUSTED" in "\n".join(records[-1].get("output_tail", [])):
          runs //= 2  # out of GPU memory: the same attempt with half the runs
          attempts.insert(0, (xla_flag, impl))
  summary = {}
  for mixer in args.mixers.split(","):
    done = {r["mode"]: r for r in records if r["mixer"] == mixer and "error" not in r}
    if len(done) == 2:
      summary[mixer] = {
          "batched_total_steps_per_sec": done["batched"]["total_steps_per_sec"],
          "single_steps_per_sec": done["single"]["total_steps_per_sec"],
          "speedup_over_one_single_process": (done["batched"]["total_steps_per_sec"]
                                              / done["single"]["total_steps_per_sec"])}
  command = results_lib.command_line("benchmarks.mqar.batched_throughput",
                                     sys.argv[1:] if argv is None else argv)
  result = {"command": command, "measurements": records, "summary": summary}
  text = json.dumps(result, indent=2)
  print(text)
  if args.output is not None:
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
  if not args.no_record:
    write_record(records, summary, args, command)


if __name__ == "__main__":
  main()

"""train.py as a researcher runs it, measured end to end on one machine (GPU or CPU).

    python -m benchmarks.lm_workflow --output_dir OUT                 # Palimpsa-D 170m
    python -m benchmarks.lm_workflow --output_dir OUT --size tiny --seq_len 64 --batch 2 \
        --steps 12 --kill_after_step 6 --checkpoint_every 4 --eval_every 4 --log_every 2 \
        --corpus_mb 1.5                                              # a CPU check, minutes

In order, each stage adding to OUT/lm_workflow.json as it completes:
1. corpus: the running Python's standard library (.py sources, and its documentation where
   installed) as JSONL documents, every 50th file held out;
2. data: `python -m palimpsa_jax.data.prepare` (a BPE of the model's vocabulary trained on the
   training files, then token shards), and how fast tokenising on the fly (data/text.py, as
   train.py would) and reading the shards produce tokens in this process;
3. train, cold: `train.py` with evaluation (no per-layer diagnostics), async checkpoints and a
   fresh compilation cache, killed (SIGKILL) once a checkpoint is complete and a few more steps
   have run;
4. train, warm: the same command again: it resumes from the last checkpoint, with the cache warm,
   and finishes; the losses of the steps both runs made are compared;
5. benchmark: `benchmarks/step/throughput.py` on the same model and batch.
The JSON gives compile_s and the time to the first step of both starts, train.py's tokens/s
(median of the logged intervals of the warm run, and overall) against the benchmark's, and the
logs of every command.
"""

import argparse
import glob
import json
import os
import pathlib
import shlex
import signal
import statistics
import subprocess
import sys
import sysconfig
import threading
import time

from benchmarks import results as results_lib
from palimpsa_jax.models import config as model_config
from palimpsa_jax.models import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]

HELD_OUT_EVERY = 50
DOC_SUFFIXES = (".py", ".rst", ".txt")


def log(message: str) -> None:
  print(f"[lm_workflow {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv):
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n")[0])
  parser.add_argument("--output_dir", required=True, help="lm_workflow.json and logs go here")
  parser.add_argument("--work_dir", default="/tmp/lm_workflow",
                      help="corpus, shards, train workdir and compilation cache (emptied first)")
  parser.add_argument("--models", dest="model", default=registry.DEFAULT,
                      help="the model (one name of the registry)")
  parser.add_argument("--size", default="170m")
  parser.add_argument("--seq_len", type=int, default=4096)
  parser.add_argument("--batch", type=int, default=8, help="global batch in sequences")
  parser.add_argument("--steps", type=int, default=150, help="total_steps of the run")
  parser.add_argument("--kill_after_step", type=int, default=40,
                      help="the cold run is killed at the first logged step >= this one that "
                           "follows a complete checkpoint")
  parser.add_argument("--checkpoint_every", type=int, default=30)
  parser.add_argument("--eval_every", type=int, default=25)
  parser.add_argument("--log_every", type=int, default=10)
  parser.add_argument("--corpus_mb", type=float, default=200,
                      help="stop collecting documents after this many MB")
  results_lib.add_record_flags(parser)  # this run's record and the benchmark's
  parser.add_argument("--extra_config", default="",
                      help="more train.py flags, e.g. '--config.model.scan_layers=True'")
  args = parser.parse_args(argv)
  if args.model not in registry.MIXERS:
    parser.error(f"--models takes one model, one of {tuple(registry.MIXERS)}, got {args.model!r}")
  return args


def build_corpus(directory: pathlib.Path, max_bytes: float) -> dict:
  """Standard-library sources and docs -> directory/{train,valid}.jsonl (up to max_bytes)."""
  roots = [sysconfig.get_paths()["stdlib"]] + glob.glob("/usr/share/doc/python3*")
  paths = sorted({p for root in roots for p in glob.glob(f"{root}/**/*", recursive=True)
                  if p.endswith(DOC_SUFFIXES) and os.path.isfile(p)
                  and "site-packages" not in p and "dist-packages" not in p})
  directory.mkdir(parents=True, exist_ok=True)
  counts = {"train": [0, 0], "valid": [0, 0]}
  with open(directory / "train.jsonl", "w") as train, open(directory / "valid.jsonl", "w") as valid:
    for index, path in enumerate(paths):
      try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
      except (UnicodeDecodeError, OSError):
        continue
      if not text.strip():
        continue
      if sum(v[1] for v in counts.values()) > max_bytes:
        break
      split = "valid" if index % HELD_OUT_EVERY == 0 else "train"
      (valid if split == "valid" else train).write(json.dumps({"text": text}) + "\n")
      counts[split][0] += 1
      counts[split][1] += len(text.encode("utf-8"))
  return {"roots": roots, "documents": {k: v[0] for k, v in counts.items()},
          "megabytes": {k: v[1] / 1e6 for k, v in counts.items()}}


def run_logged(command: list[str], log_path: pathlib.Path, timeout: float) -> float:
  """Runs command to completion (output to log_path); returns its wall seconds."""
  log(f"$ {shlex.join(command)}")
  start = time.perf_counter()
  with open(log_path, "a") as f:
    f.write(f"$ {shlex.join(command)}\n")
    f.flush()
    subprocess.run(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True,
                   timeout=timeout)
  return time.perf_counter() - start


def tokens_per_second(make_iterator, seconds: float = 8.0) -> float:
  """Tokens/s of an iterator of {"tokens": [b, T]} batches over about `seconds`."""
  iterator = make_iterator()
  next(iterator)  # Start-up (threads, first documents) is not counted.
  start, tokens = time.perf_counter(), 0
  while time.perf_counter() - start < seconds:
    tokens += next(iterator)["tokens"].size
  return tokens / (time.perf_counter() - start)


def data_rates(corpus: pathlib.Path, shards: pathlib.Path, seq_len: int, batch: int) -> dict:
  from palimpsa_jax.data import text, token_shards, tokenizer  # pylint: disable=g-import-not-at-top
  tok = tokenizer.load_tokenizer(str(shards / "tokenizer.json"))
  return {
      "on_the_fly_tokens_per_s": tokens_per_second(lambda: iter(text.make_text_dataset(
          str(corpus / "train.jsonl"), tok, seq_len, batch, seed=0))),
      "shards_tokens_per_s": tokens_per_second(lambda: iter(token_shards.make_shard_dataset(
          str(shards / "*.npy"), seq_len, batch, seed=0))),
      "cpu_count": os.cpu_count(),
  }


def train_command(args, work: pathlib.Path) -> list[str]:
  config = (f"configs/lm.py:model={args.model},size={args.size},seq_len={args.seq_len},"
            f"batch_size={args.batch},total_steps={args.steps},"
            f"warmup_steps={max(args.steps // 10, 1)}")
  return [sys.executable, "train.py", f"--config={config}", f"--workdir={work / 'run'}",
          f"--config.data.train_files={work / 'tokens_train'}/*.npy",
          f"--config.data.eval_files={work / 'tokens_valid'}/*.npy",
          "--config.data.eval_batches=4",
          # The per-layer diagnostics would add a third cold compile to the time budget.
          "--config.log_diagnostics=False",
          f"--config.log_every_steps={args.log_every}",
          f"--config.eval_every_steps={args.eval_every}",
          f"--config.checkpoint_every_steps={args.checkpoint_every}",
          f"--compilation_cache_dir={work / 'jax_cache'}",
          *shlex.split(args.extra_config)]


def run_until_killed(command: list[str], log_path: pathlib.Path, checkpoints: pathlib.Path,
                     kill_after_step: int, timeout: float) -> dict:
  """Runs train.py and SIGKILLs it at a logged step >= kill_after_step once a checkpoint exists."""
  log(f"$ {shlex.join(command)}  (killed after step {kill_after_step})")
  start = time.perf_counter()
  with open(log_path, "w") as f:
    f.write(f"$ {shlex.join(command)}\n")
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    # Also while it prints nothing (compiling): the kill ends its output, and the loop.
    watchdog = threading.Timer(timeout, os.killpg, (process.pid, signal.SIGKILL))
    watchdog.start()
    killed_at = None
    for line in process.stdout:
      f.write(line)
      f.flush()
      if line.startswith("step "):
        step = int(line.split()[1].split("/")[0])
        complete = [int(p.name) for p in checkpoints.glob("*") if p.name.isdigit()]
        if step >= kill_after_step and complete:
          killed_at = step
          break
    watchdog.cancel()
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
    process.wait()
  return {"killed_at_step": killed_at, "wall_s": time.perf_counter() - start}


def read_metrics(workdir: pathlib.Path) -> list[dict]:
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f if line.strip()]


def startup(records: list[dict]) -> dict:
  first = [r for r in records if "perf/compile_s" in r]
  return {k.split("/")[1]: first[-1][k] for k in
          ("perf/compile_s", "perf/lower_s", "perf/compile_cache_hits",
           "perf/time_to_first_step_s")} if first else {}


def main(argv=None) -> dict:
  args = parse_args(argv)
  out = pathlib.Path(args.output_dir)
  out.mkdir(parents=True, exist_ok=True)
  work = pathlib.Path(args.work_dir)
  if work.exists():
    subprocess.run(["rm", "-rf", str(work)], check=True)
  work.mkdir(parents=True)
  # No JAX backend in this process: it would take the accelerator's memory from train.py.
  result = {"date": results_lib.utc_now(),
            "command": results_lib.command_line("benchmarks.lm_workflow", argv or sys.argv[1:]),
            "model": args.model, "size": args.size,
            "tokens_per_step": args.batch * args.seq_len}
  report = out / "lm_workflow.json"

  def save(stage: str) -> None:
    report.write_text(json.dumps(result, indent=2))
    log(f"{stage} done -> {report}")

  result["corpus"] = build_corpus(work / "corpus", args.corpus_mb * 1e6)
  save("corpus")

  vocab = model_config.model_config(args.model, args.size).vocab_size
  prepare = [sys.executable, "-m", "palimpsa_jax.data.prepare"]
  data_log = out / "data.log"
  result["prepare_train_s"] = run_logged(
      prepare + ["--files", str(work / "corpus" / "train.jsonl"), "--tokenizer", f"bpe:{vocab}",
                 "--output", str(work / "tokens_train")], data_log, 240)
  result["prepare_valid_s"] = run_logged(
      prepare + ["--files", str(work / "corpus" / "valid.jsonl"), "--tokenizer",
                 str(work / "tokens_train" / "tokenizer.json"),
                 "--output", str(work / "tokens_valid")], data_log, 60)
  result["tokens"] = json.loads((work / "tokens_train" / "manifest.json").read_text())[
      "num_tokens"]
  result["data_rates"] = data_rates(work / "corpus", work / "tokens_train", args.seq_len,
                                    args.batch)
  save("data")

  command = train_command(args, work)
  result["train_command"] = shlex.join(["python"] + command[1:])
  cold = run_until_killed(command, out / "train_cold.log", work / "run" / "checkpoints",
                          args.kill_after_step, 330)
  cold_records = read_metrics(work / "run")
  result["cold"] = {**cold, **startup(cold_records)}
  save("cold start")

  warm_start = len(cold_records)
  result["warm"] = {"wall_s": run_logged(command, out / "train_warm.log", 180)}
  records = read_metrics(work / "run")
  warm_records = records[warm_start:]
  summary = json.loads((work / "run" / "summary.json").read_text())
  warm_log = (out / "train_warm.log").read_text()
  resumed = [line for line in warm_log.splitlines() if line.startswith("resumed from")]
  losses_cold = {r["step"]: r["train/loss"] for r in cold_records if "train/loss" in r}
  losses_warm = {r["step"]: r["train/loss"] for r in warm_records if "train/loss" in r}
  both = sorted(set(losses_cold) & set(losses_warm))
  intervals = [r["perf/tokens_per_sec"] for r in warm_records if "perf/tokens_per_sec" in r]
  result["warm"].update(startup(warm_records), resumed=resumed, summary=summary,
                        logged_tokens_per_s=intervals,
                        median_tokens_per_s=statistics.median(intervals) if intervals else None,
                        overall_tokens_per_s=summary.get("tokens_per_sec"),
                        steps_run_twice=both,
                        max_loss_difference=max((abs(losses_cold[s] - losses_warm[s])
                                                 for s in both), default=None))
  if result["cold"].get("compile_s") and result["warm"].get("compile_s"):
    result["compile_speedup"] = result["cold"]["compile_s"] / result["warm"]["compile_s"]
  save("warm start")

  bench_json = out / "train_throughput.json"
  run_logged([sys.executable, "-m", "benchmarks.step.throughput", "--models", args.model,
              "--size", args.size, "--seq_len", str(args.seq_len),
              "--batch_size", str(args.batch), "--steps", "10", "--warmup_steps", "3",
              "--output", str(bench_json),
              *(["--no_record"] if args.no_record else ["--records", args.records]),
              # Host initialisation is the same program as train.py's; the train step is
              # not (a batch without segment ids), so it is compiled cold.
              "--compilation_cache_dir", str(work / "jax_cache"),
              *(["--scan_layers", "on"] if "scan_layers=True" in args.extra_config else [])],
             out / "benchmark.log", 280)
  bench_result = json.loads(bench_json.read_text())
  bench = bench_result["rows"][0]["tokens_per_s"]
  result.update(device=bench_result["device"], jax=bench_result["jax"],
                benchmark_tokens_per_s=bench)
  if result["warm"]["median_tokens_per_s"]:
    result["train_over_benchmark"] = result["warm"]["median_tokens_per_s"] / bench
  if result["warm"]["overall_tokens_per_s"]:
    result["train_overall_over_benchmark"] = result["warm"]["overall_tokens_per_s"] / bench
  save("benchmark")
  if not args.no_record:
    record = results_lib.make_record(
        "lm_workflow", f"lm_workflow (train.py end to end, {args.model} {args.size})",
        result["command"], date=result["date"], device=bench_result["device"],
        num_devices=bench_result["num_devices"], backend=bench_result["backend"],
        versions={"jax": bench_result["jax"]},
        settings={"model": args.model, "size": args.size, "seq_len": args.seq_len,
                  "batch": args.batch, "scan_layers": "scan_layers=True" in args.extra_config},
        notes=[f"train command: {result['train_command']}"],
        figures={f"{start}_{name}": result[start].get(name) for start in ("cold", "warm")
                 for name in ("lower_s", "compile_s", "time_to_first_step_s")}
        | {"compile_speedup": result.get("compile_speedup"),
           "train_median_tokens_per_s": result["warm"]["median_tokens_per_s"],
           "train_overall_tokens_per_s": result["warm"]["overall_tokens_per_s"],
           "benchmark_tokens_per_s": bench,
           "max_loss_difference": result["warm"]["max_loss_difference"]})
    log(f"wrote {results_lib.write_record(record, args.records)}")
  print(json.dumps({k: result.get(k) for k in (
      "compile_speedup", "train_over_benchmark", "train_overall_over_benchmark",
      "benchmark_tokens_per_s")} | {"cold": {k: result["cold"].get(k) for k in (
          "compile_s", "time_to_first_step_s")}, "warm": {k: result["warm"].get(k) for k in (
              "compile_s", "time_to_first_step_s", "median_tokens_per_s")}}, indent=2))
  return result


if __name__ == "__main__":
  main()

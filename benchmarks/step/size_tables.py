"""The model-size tables of docs/results/training.md, measured in one call within a time budget.

    python -m benchmarks.step.size_tables --output_dir OUT --budget_s 530
    python -m benchmarks.step.size_tables --render OUT/size_tables.json   # the markdown tables

Stages, most important first, each a benchmarks/step/throughput.py process (bf16 compute, f32
parameters, configs/lm.py optimizer, random tokens) whose rows are merged into
OUT/size_tables.json as soon as it ends:
  760m       the five mixers at 760M, scanned layers + remat (x Mamba2 within the stage);
  2.7b       Palimpsa-D at 2.7B, scanned layers + remat;
  170m_scan  Palimpsa-D at 170M with scanned layers;
  170m_loop  Palimpsa-D at 170M with unrolled layers (the current default);
  760m_loop  Palimpsa-D at 760M, unrolled layers + remat.
A stage starts only if at least its least time is left in the budget, runs at most its most
time (or what is left), and a failed or cut-short stage keeps the rows it finished (with the end
of its log). Each completed stage writes its run's record to --records (benchmarks/records/).
"""

import argparse
import json
import pathlib
import shlex
import subprocess
import sys
import time

from benchmarks import results as results_lib
from palimpsa_jax.models import registry

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The paper's five mixers: the baseline first, then the ones train_throughput times by default.
FIVE = ",".join(dict.fromkeys((registry.BASELINE, *registry.THROUGHPUT, *registry.PAPER_MQAR)))

# (name, train_throughput flags, seconds: the least worth starting with, the most it may take).
STAGES = (
    ("760m", ["--size", "760m", "--models", FIVE, "--scan_layers", "on",
              "--remat", "--batch_size", "8", "--device_batch", "8"], 120, 300),
    ("2.7b", ["--size", "2.7b", "--models", registry.DEFAULT, "--scan_layers", "on", "--remat",
              "--batch_size", "4", "--device_batch", "4"], 60, 150),
    ("170m_scan", ["--size", "170m", "--models", registry.DEFAULT, "--scan_layers", "on",
                   "--batch_size", "4"], 40, 90),
    ("170m_loop", ["--size", "170m", "--models", registry.DEFAULT, "--scan_layers", "off",
                   "--batch_size", "4"], 120, 240),
    ("760m_loop", ["--size", "760m", "--models", registry.DEFAULT, "--scan_layers", "off",
                   "--remat", "--batch_size", "8", "--device_batch", "8"], 150, 300),
)
COMMON = ["--seq_len", "4096", "--steps", "5", "--warmup_steps", "2"]


def log(message: str) -> None:
  print(f"[size_tables {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_stage(name: str, flags: list[str], seconds: float, out: pathlib.Path,
              records: str | None = None) -> dict:
  """One step/throughput.py process; its rows (as far as it got) and status. A stage that
  completes writes its record to `records` (None: no record)."""
  output = out / f"size_tables_{name}.json"  # In the run's own folder: runs never share it.
  output.unlink(missing_ok=True)
  command = [sys.executable, "-m", "benchmarks.step.throughput", *COMMON, *flags,
             "--output", str(output), *(["--records", records] if records else ["--no_record"])]
  log(f"{name}: $ {shlex.join(command)} (at most {seconds:.0f} s)")
  start = time.perf_counter()
  with open(out / "size_tables.log", "a") as f:
    f.write(f"\n== {name}: $ {shlex.join(command)}\n")
    f.flush()
    try:
      done = subprocess.run(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                            timeout=seconds)
      status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
    except subprocess.TimeoutExpired:
      status = f"cut at {seconds:.0f} s"
  stage = {"command": "python " + shlex.join(command[1:]), "status": status,
           "wall_s": time.perf_counter() - start}
  if output.exists():
    saved = json.loads(output.read_text())
    stage.update(rows=saved.get("rows", []), tokens_per_step=saved.get("tokens_per_step"),
                 device=saved.get("device"), jax=saved.get("jax"), date=saved.get("date"))
  if status != "ok":
    lines = (out / "size_tables.log").read_text().splitlines()
    stage["log_tail"] = lines[-15:]
  return stage


def _fmt(value, pattern: str) -> str:
  return "n/a" if value is None else format(value, pattern)


def render(result: dict) -> str:
  """Markdown: one table per stage (model, scanned, remat, tokens/step, tokens/s, step ms,
  peak GiB, batch that fits, compile s, x Mamba2)."""
  parts = []
  for name, stage in result["stages"].items():
    remat = "--remat" in stage["command"]
    if not stage.get("rows"):
      parts.append(f"{name}: {stage['status']}, no rows (`{stage['command']}`)\n")
      continue
    parts.append(f"{name} ({stage.get('device')}, jax {stage.get('jax')}, {stage.get('date')}, "
                 f"{stage['status']}):\n`{stage['command']}`\n")
    parts.append("| model | params (M) | scanned | remat | tokens/step | microbatches "
                 "| tokens/s | step ms | peak GiB | batch that fits (est.) | compile s "
                 "| x Mamba2 step |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in stage.get("rows", []):
      parts.append(
          f"| {r['model']} | {r['params'] / 1e6:.0f} | {'yes' if r['scan_layers'] else 'no'} "
          f"| {'yes' if remat else 'no'} | {stage.get('tokens_per_step')} "
          f"| {r.get('grad_accum_steps')} "
          f"| {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} "
          f"| {_fmt(r.get('peak_gib'), '.1f')} | {_fmt(r.get('batch_that_fits'), 'd')} "
          f"| {r['compile_s']:.1f} | {_fmt(r.get('x_mamba2'), '.2f')} |")
    parts.append("")
  return "\n".join(parts)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n")[0])
  parser.add_argument("--output_dir", help="size_tables.json, .md and .log go here")
  parser.add_argument("--budget_s", type=float, default=530, help="seconds for all stages")
  parser.add_argument("--stages", default=",".join(s[0] for s in STAGES),
                      help="comma-separated stage names, in order")
  parser.add_argument("--render", default="", help="print the tables of a size_tables.json")
  results_lib.add_record_flags(parser)  # each completed stage's record
  args = parser.parse_args(argv)
  if args.render:
    text = render(json.loads(pathlib.Path(args.render).read_text()))
    print(text)
    return {"markdown": text}
  if not args.output_dir:
    parser.error("--output_dir is required (or --render FILE)")
  known = {s[0]: s for s in STAGES}
  names = [n for n in args.stages.split(",") if n]
  for name in names:
    if name not in known:
      parser.error(f"--stages: {name!r} is not one of {', '.join(known)}")
  out = pathlib.Path(args.output_dir)
  out.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  result = {"budget_s": args.budget_s, "stages": {}}
  for name in names:
    _, flags, least, most = known[name]
    left = args.budget_s - (time.perf_counter() - start)
    if left < least:
      result["stages"][name] = {"command": "python -m benchmarks.step.throughput "
                                           + shlex.join(COMMON + flags),
                                "status": f"skipped: {max(left, 0):.0f} s left of the budget"}
      continue
    result["stages"][name] = run_stage(name, flags, min(left, most), out,
                                       None if args.no_record else args.records)
    (out / "size_tables.json").write_text(json.dumps(result, indent=2))
    (out / "size_tables.md").write_text(render(result))
    log(f"{name}: {result['stages'][name]['status']}")
  (out / "size_tables.json").write_text(json.dumps(result, indent=2))
  (out / "size_tables.md").write_text(render(result))
  print(render(result))
  return result


if __name__ == "__main__":
  main()

"""The paper's MQAR sweep: train the grid in batched groups, resume, report, plot.

Grid (the paper's MQAR setting, configs/mqar.py:preset=paper): 5 mixers (registry.PAPER_MQAR)
(Palimpsa-D, NotPalimpsa, MetaMamba2, Mamba2, Gated DeltaNet; --models chooses others) x (seq_len, kv) in {(512, 128), (1024, 256)} x lr in
{1e-3, 2.15e-3, 4.64e-3, 1e-2} x 3 seeds, early stop at 99% test accuracy.
Each run has its workdir ROOT/<run name> with the files of a train.py run.

The runs of one mixer and setting (a "cell") train together in one process
(palimpsa_jax/training/batched.py: one vmapped step for all learning rates and
seeds). `run` trains the unfinished runs of its cells and resumes every run
from its checkpoints, so it can be stopped at any time (SIGTERM, e.g. from
`timeout`, or Ctrl-C checkpoints every running run first) and started again:

  # the whole grid on one GPU, in slots: repeat until `status` shows 0 left
  timeout -k 60 1440 python -m benchmarks.mqar.sweep run --root runs/mqar_sweep
  # a slot of 10 minutes on a machine that keeps no files: stop after 8 minutes of training
  # (exit code 75: run again), pack the latest checkpoints into parts of at most 15 MiB,
  # carry them to the next slot and unpack them there (docs/mqar.md, "Short GPU slots")
  python -m benchmarks.mqar.sweep run --root R --time_budget 8 ...; \
    python -m benchmarks.mqar.sweep pack --root R --carry OUT ...
  python -m benchmarks.mqar.sweep unpack --root R --carry OUT
  # two-stage: each cell's learning rate from seed-0 runs, then seeds 1, 2 at it
  timeout -k 60 1440 python -m benchmarks.mqar.sweep run --root runs/mqar_sweep --two_stage
  # one worker (shard of the cells) per GPU
  python -m benchmarks.mqar.sweep run --root runs/mqar_sweep --gpus 0,1
  # shortened: fewer examples / epochs, one seed, one setting
  python -m benchmarks.mqar.sweep run --root R --seeds 0 --settings 512:128 --epochs 8
  # runs finished / running / left, steps done, GPU time left at the measured rates
  python -m benchmarks.mqar.sweep status --root runs/mqar_sweep
  # results.json, accuracy.png and accuracy_vs_step.png under ROOT, a record of every
  # run (unfinished runs count with their best evaluation so far) beside them, or for the
  # project's sweep into the records rendered into docs/results/mqar.md
  python -m benchmarks.mqar.sweep collect --root runs/mqar_sweep --records benchmarks/records

`status`, `collect`, `list` and `pack` take the same grid flags as `run`. The plot
shows, per mixer and setting, mean +- std over seeds of each seed's best
accuracy over learning rates (`collect`'s report: benchmarks/mqar/report.py).
"""

import argparse
import contextlib
import dataclasses
import importlib.util
import itertools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tarfile
import time

from benchmarks import results as results_lib
from benchmarks.mqar.report import read_run_metrics, report
from palimpsa_jax.models import registry

REPO = pathlib.Path(__file__).resolve().parents[2]

MIXERS = registry.PAPER_MQAR  # The paper's MQAR comparison (registry.Mixer.paper_mqar).
SETTINGS = ((512, 128), (1024, 256))
LEARNING_RATES = (1e-3, 2.15e-3, 4.64e-3, 1e-2)
SEEDS = (0, 1, 2)
# `run`'s exit code when --time_budget stopped it (every running run checkpointed): run again.
BUDGET_EXIT = 75
# `pack`'s parts: "sweep_carry.tar.00", "sweep_carry.tar.01", ... (at most --part_mib each).
CARRY_NAME = "sweep_carry.tar"


@dataclasses.dataclass(frozen=True)
class Run:
  mixer: str
  seq_len: int
  kv: int
  lr: float
  seed: int

  @property
  def name(self) -> str:
    return f"{self.mixer}_L{self.seq_len}_kv{self.kv}_lr{self.lr:g}_s{self.seed}"

  def config_arg(self, extra: dict[str, object]) -> str:
    args = {"preset": "paper", "model": self.mixer, "seq_len": self.seq_len,
            "num_kv_pairs": self.kv, "learning_rate": self.lr, "seed": self.seed, **extra}
    return ",".join(f"{k}={v}" for k, v in args.items())


def grid(mixers=MIXERS, settings=SETTINGS, lrs=LEARNING_RATES, seeds=SEEDS) -> list[Run]:
  """Every run of the sweep, in a fixed order."""
  return [Run(m, s[0], s[1], lr, seed) for m, s, lr, seed in
          itertools.product(mixers, settings, lrs, seeds)]


def shard(items: list, spec: str) -> list:
  """The items of shard "i/n" (every n-th from the i-th)."""
  try:
    index, count = (int(x) for x in spec.split("/"))
  except ValueError:
    raise ValueError(f"--shard must look like i/n, got {spec!r}.") from None
  if not 0 <= index < count:
    raise ValueError(f"--shard {spec}: need 0 <= i < n.")
  return items[index::count]


def is_finished(root: pathlib.Path, run: Run) -> bool:
  return (root / run.name / "summary.json").exists()


def mqar_config(arg: str):
  """train.py's config for --config=configs/mqar.py:ARG."""
  spec = importlib.util.spec_from_file_location("mqar_config", REPO / "configs" / "mqar.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def run_config(run: Run, extra: dict[str, object]):
  """The run's train.py config (configs/mqar.py:preset=paper,...)."""
  return mqar_config(run.config_arg(extra))


def planned_steps(config) -> int:
  """Training steps of the run's full schedule."""
  if config.total_steps is not None:
    return config.total_steps
  return config.num_epochs * (config.data.num_train_examples // config.batch_size)


def latest_checkpoint(workdir: pathlib.Path) -> int | None:
  """The step of the run's latest finished Orbax checkpoint, or None."""
  steps = [int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit()]
  return max(steps, default=None)


def cells(runs: list[Run]) -> dict[tuple[str, int, int], list[Run]]:
  """The runs grouped by (mixer, seq_len, kv), in grid order."""
  grouped: dict[tuple[str, int, int], list[Run]] = {}
  for run in runs:
    grouped.setdefault((run.mixer, run.seq_len, run.kv), []).append(run)
  return grouped


def best_lr(root: pathlib.Path, runs: list[Run]) -> float | None:
  """The learning rate of the run with the highest best accuracy, once all are finished.

  Ties go to the run that reached it first, then to the smaller rate.
  """
  if not all(is_finished(root, run) for run in runs):
    return None
  def key(run):
    summary = json.loads((root / run.name / "summary.json").read_text())
    return (-(summary["best_accuracy"] or 0.0), summary["best_step"] or 0, run.lr)
  return min(runs, key=key).lr


def planned_runs(root: pathlib.Path, runs: list[Run], two_stage: bool) -> list[Run]:
  """The runs to train now.

  two_stage: of `runs`, the first seed's only; once a cell's first-seed runs are
  all finished, also its other seeds at the cell's best learning rate.
  """
  if not two_stage:
    return runs
  seeds = list(dict.fromkeys(run.seed for run in runs))
  planned = []
  for (mixer, seq_len, kv), cell in cells(runs).items():
    first = [run for run in cell if run.seed == seeds[0]]
    planned += first
    lr = best_lr(root, first)
    if lr is not None:
      planned += [Run(mixer, seq_len, kv, lr, seed) for seed in seeds[1:]]
  return planned


class TimeBudget:
  """A stop request once `minutes` of wall time have passed since it was made (None: never)."""

  def __init__(self, minutes: float | None):
    self._deadline = None if minutes is None else time.monotonic() + 60 * minutes

  def __call__(self) -> bool:
    return self._deadline is not None and time.monotonic() >= self._deadline


def train_cells(root: pathlib.Path, grid_runs: list[Run], cell_keys: list[tuple],
                extra: dict[str, object], two_stage: bool,
                time_budget: float | None = None) -> None:
  """Trains every unfinished run of the given cells, one batched group at a time.

  A cell's unfinished runs train as one group, or as one group per resume
  step where their checkpoints differ. With two_stage, a cell's later seeds
  follow in the same call once its first-seed runs are finished. After
  `time_budget` minutes (None: no limit) the running group checkpoints its runs and
  the process exits with BUDGET_EXIT, as a signal makes it exit with 128 + its number.
  """
  # Imported here: `collect` and `status` need no accelerator.
  from palimpsa_jax.training import batched  # pylint: disable=g-import-not-at-top
  from palimpsa_jax.training import bookkeeping  # pylint: disable=g-import-not-at-top
  stop = bookkeeping.StopSignals()  # SIGINT, SIGTERM: the running group checkpoints
  budget = TimeBudget(time_budget)
  try:
    with stop:
      for key in cell_keys:
        while True:
          cell = cells(planned_runs(root, grid_runs, two_stage)).get(key, [])
          todo = [run for run in cell if not is_finished(root, run)]
          if not todo:
            break
          by_step: dict[int | None, list[Run]] = {}
          for run in todo:
            by_step.setdefault(latest_checkpoint(root / run.name), []).append(run)
          for step, group in by_step.items():
            names = ", ".join(f"lr {run.lr:g} s{run.seed}" for run in group)
            print(f"{key[0]} L={key[1]} kv={key[2]}: {len(group)} runs ({names}) from "
                  f"step {step or 0}", flush=True)
            batched.train_group([run_config(run, extra) for run in group],
                                [str(root / run.name) for run in group],
                                should_stop=lambda: stop() or budget())
  except bookkeeping.Interrupted as interrupted:
    print(interrupted, file=sys.stderr, flush=True)
    if stop():
      raise SystemExit(stop.exit_code) from None
    print(f"the time budget of {time_budget:g} minutes is spent: run the same command again "
          "to resume", file=sys.stderr, flush=True)
    raise SystemExit(BUDGET_EXIT) from None


def carried_files(workdir: pathlib.Path) -> list[pathlib.Path]:
  """What a run needs to resume elsewhere: its files and its latest checkpoint only (older
  checkpoints, unfinished saves and the lock file stay behind)."""
  latest = latest_checkpoint(workdir)
  files = []
  for path in sorted(workdir.rglob("*")):
    parts = path.relative_to(workdir).parts
    if not path.is_file() or parts == ("lock",):
      continue
    if parts[0] == "checkpoints" and (len(parts) < 3 or parts[1] != str(latest)):
      continue
    files.append(path)
  return files


def pack(root: pathlib.Path, runs: list[Run], carry: pathlib.Path, part_mib: float,
         most_mib: float) -> list[pathlib.Path]:
  """Writes the started runs of `runs` (carried_files) as one tar archive split into parts
  carry/CARRY_NAME.NN of at most `part_mib` MiB; refuses archives over `most_mib` MiB.

  Returns the parts' paths. `unpack` puts them back under another root.
  """
  files = [f for run in runs if (root / run.name).is_dir()
           for f in carried_files(root / run.name)]
  if not files:
    raise SystemExit(f"pack: no run of the grid under {root} to carry.")
  size_mib = sum(f.stat().st_size for f in files) / 2**20
  if size_mib > most_mib:
    raise SystemExit(f"pack: the runs' latest checkpoints and files take {size_mib:.1f} MiB, "
                     f"more than --most_mib {most_mib:g}; pack fewer runs (--lrs, --seeds).")
  carry.mkdir(parents=True, exist_ok=True)
  for old in carry.glob(f"{CARRY_NAME}.*"):
    old.unlink()
  archive = carry / CARRY_NAME
  with tarfile.open(archive, "w") as tar:
    for path in files:
      tar.add(path, arcname=str(path.relative_to(root)))
  part_bytes = int(part_mib * 2**20)
  parts = []
  with archive.open("rb") as whole:
    while chunk := whole.read(part_bytes):
      parts.append(carry / f"{CARRY_NAME}.{len(parts):02d}")
      parts[-1].write_bytes(chunk)
  archive.unlink()
  return parts


def unpack(root: pathlib.Path, carry: pathlib.Path) -> list[str]:
  """Puts `pack`'s parts in `carry` back under `root`; returns the run names.

  A run folder already under `root` is replaced by the carried one, unless its latest
  checkpoint is later than the carried one's (then nothing is unpacked).
  """
  parts = sorted(carry.glob(f"{CARRY_NAME}.[0-9][0-9]"))
  if not parts:
    raise SystemExit(f"unpack: no {CARRY_NAME}.NN parts in {carry}.")
  archive = root / f".{CARRY_NAME}"
  root.mkdir(parents=True, exist_ok=True)
  with archive.open("wb") as whole:
    for part in parts:
      whole.write(part.read_bytes())
  try:
    with tarfile.open(archive) as tar:
      carried_steps: dict[str, list[int]] = {}
      for member in tar.getmembers():
        parts = pathlib.PurePosixPath(member.name).parts
        steps = carried_steps.setdefault(parts[0], [])
        if len(parts) > 2 and parts[1] == "checkpoints" and parts[2].isdigit():
          steps.append(int(parts[2]))
      for name, steps in carried_steps.items():
        here, carried = latest_checkpoint(root / name), max(steps, default=None)
        if here is not None and (carried is None or here > carried):
          raise SystemExit(f"unpack: {root / name} holds checkpoint {here}, later than the "
                           f"carried {carried}; nothing unpacked (move that run away to "
                           "take the carried one).")
      for name in carried_steps:
        if (root / name).exists():
          shutil.rmtree(root / name)
      tar.extractall(root, filter="data")
  finally:
    archive.unlink()
  return sorted(carried_steps)


def _median(values: list[float]) -> float | None:
  values = sorted(values)
  return values[len(values) // 2] if values else None


def status(root: pathlib.Path, grid_runs: list[Run], extra: dict[str, object],
           two_stage: bool) -> list[dict[str, object]]:
  """Per cell: runs finished / running / left, steps done and left, rate, GPU time left.

  A run is running once it has a checkpoint or a logged step but no summary.
  The rate is the median steps/s per run of the cell's last logged steps (in
  a batched group every run advances at the group's rate). A cell's GPU time
  left is its most remaining steps over that rate (with two_stage: that of the
  first seed's runs plus that of the later seeds'): an upper bound, as runs
  may stop early. Cells not measured yet borrow the median rate of the
  measured cells of the same setting. With two_stage, a cell's later seeds
  count as left (at the full schedule) until their learning rate is chosen.
  """
  planned = planned_runs(root, grid_runs, two_stage)
  seeds = list(dict.fromkeys(run.seed for run in grid_runs))
  rows = []
  for key, cell in cells(planned).items():
    total = planned_steps(run_config(cell[0], extra))
    row = {"mixer": key[0], "seq_len": key[1], "kv": key[2], "finished": 0,
           "running": 0, "left": 0, "steps_done": 0, "steps_planned": 0}
    stage_left = {}  # stage (0: first seed, 1: later seeds with two_stage) -> most left
    rates = []
    runs = [(run, True) for run in cell]
    if two_stage and not any(run.seed != seeds[0] for run in cell):
      runs += [(None, False)] * (len(seeds) - 1)
    for run, exists in runs:
      done, ended = 0, False
      if exists and is_finished(root, run):
        done, ended = json.loads((root / run.name / "summary.json").read_text())[
            "final_step"], True
        row["finished"] += 1
      elif exists and (read_run_metrics(root / run.name) or latest_checkpoint(root / run.name)):
        done = max([r["step"] for r in read_run_metrics(root / run.name)] +
                   [latest_checkpoint(root / run.name) or 0])
        row["running"] += 1
      else:
        row["left"] += 1
      if exists:
        rates += [r["perf/steps_per_sec"] for r in read_run_metrics(root / run.name)[-10:]
                  if "perf/steps_per_sec" in r]
      row["steps_done"] += done
      row["steps_planned"] += done if ended else total
      if not ended:
        stage = int(two_stage and (run is None or run.seed != seeds[0]))
        stage_left[stage] = max(stage_left.get(stage, 0), total - done)
    row["steps_left"] = sum(stage_left.values())
    row["steps_per_sec"] = _median(rates)
    row["rate_measured"] = row["steps_per_sec"] is not None
    rows.append(row)
  for row in rows:
    if not row["rate_measured"]:
      row["steps_per_sec"] = _median([r["steps_per_sec"] for r in rows if r["rate_measured"]
                                      and r["seq_len"] == row["seq_len"]])
    rate = row["steps_per_sec"]
    row["gpu_hours_left"] = (0.0 if not row["steps_left"] else None if rate is None
                             else row["steps_left"] / rate / 3600)
  return rows


def format_status(rows: list[dict[str, object]]) -> str:
  lines = ["| cell | finished | running | left | steps done | steps/s per run | "
           "GPU h left |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    rate = "n/a" if r["steps_per_sec"] is None else (
        f"{r['steps_per_sec']:.1f}" + ("" if r["rate_measured"] else " (other mixers)"))
    hours = "n/a" if r["gpu_hours_left"] is None else f"{r['gpu_hours_left']:.2f}"
    lines.append(f"| {r['mixer']} L={r['seq_len']} kv={r['kv']} | {r['finished']} | "
                 f"{r['running']} | {r['left']} | {r['steps_done']:,} / "
                 f"{r['steps_planned']:,} | {rate} | {hours} |")
  count = lambda k: sum(r[k] for r in rows)
  known = [r["gpu_hours_left"] for r in rows if r["gpu_hours_left"] is not None]
  unknown = sum(1 for r in rows if r["gpu_hours_left"] is None)
  lines.append(
      f"runs: {count('finished')} finished, {count('running')} running, "
      f"{count('left')} left; steps {count('steps_done'):,} of {count('steps_planned'):,}; "
      f"GPU time left at the measured rates, one group at a time, no early stops: "
      f"{sum(known):.2f} h" + (f" + {unknown} cells without a rate" if unknown else ""))
  return "\n".join(lines)


def worker_env(gpu: str, gpus: list[str]) -> dict[str, str]:
  """The environment of the worker on `gpu`; workers sharing a GPU allocate on demand.

  (JAX otherwise preallocates 75% of the GPU's memory in the first process.)
  """
  env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)
  if gpus.count(gpu) > 1:
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  return env


@contextlib.contextmanager
def mps_daemon(enabled: bool):
  """Runs NVIDIA's MPS control daemon meanwhile, when enabled.

  Under MPS the kernels of the workers that share a GPU run concurrently
  instead of in time slices.
  """
  if not enabled:
    yield
    return
  control = shutil.which("nvidia-cuda-mps-control")
  if control is None:
    raise SystemExit("--mps: nvidia-cuda-mps-control is not on PATH.")
  subprocess.run([control, "-d"], check=True, stdin=subprocess.DEVNULL)
  try:
    yield
  finally:
    subprocess.run([control], input="quit\n", text=True, check=False)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n")[0])
  parser.add_argument("command", choices=("run", "status", "collect", "list", "pack", "unpack"))
  parser.add_argument("--root", required=True, type=pathlib.Path)
  parser.add_argument("--shard", default="0/1",
                      help="i/n: run every n-th cell (mixer x setting) from i.")
  parser.add_argument("--gpus", default=None,
                      help="comma-separated GPU ids: one worker (shard) per entry; "
                           "repeat an id to run several workers on that GPU.")
  parser.add_argument("--mps", action="store_true",
                      help="with --gpus: run the workers under NVIDIA MPS (as root).")
  parser.add_argument("--models", dest="mixers", default=",".join(MIXERS),
                      help="comma-separated mixers")
  parser.add_argument("--settings", default="512:128,1024:256")
  parser.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in LEARNING_RATES))
  parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
  parser.add_argument("--two_stage", action="store_true",
                      help="first seed at every lr; then the other seeds at each "
                           "cell's best lr.")
  parser.add_argument("--examples", type=int, default=None, help="shorten: training examples.")
  parser.add_argument("--epochs", type=int, default=None, help="shorten: epochs.")
  parser.add_argument(
      "--records", type=pathlib.Path, default=None,
      help="collect: folder of the sweep's JSON record (default: --root, beside the runs; "
           "the project's sweep: benchmarks/records)")
  parser.add_argument("--no_record", action="store_true", help="collect: write no record")
  parser.add_argument("--time_budget", type=float, default=None,
                      help="run: minutes of training, then checkpoint and exit with code "
                           f"{BUDGET_EXIT}; the same command resumes")
  parser.add_argument("--carry", type=pathlib.Path, default=None,
                      help="pack: the folder the parts are written to; unpack: read from")
  parser.add_argument("--part_mib", type=float, default=15.0,
                      help="pack: most MiB in one part")
  parser.add_argument("--most_mib", type=float, default=60.0,
                      help="pack: refuse to pack more MiB than this")
  args = parser.parse_args(argv)

  mixers = [m for m in args.mixers.split(",") if m]
  settings = [tuple(int(x) for x in s.split(":")) for s in args.settings.split(",")]
  runs = grid(mixers, settings, [float(x) for x in args.lrs.split(",")],
              [int(x) for x in args.seeds.split(",")])
  extra = {k: v for k, v in (("num_train_examples", args.examples), ("num_epochs", args.epochs))
           if v is not None}
  root = args.root.resolve()
  if args.command in ("pack", "unpack") and args.carry is None:
    parser.error(f"{args.command} needs --carry (the folder of the parts)")
  for name in ("time_budget", "part_mib", "most_mib"):
    value = getattr(args, name)
    if value is not None and value <= 0:
      parser.error(f"--{name} must be positive, got {value:g}")
  if args.command == "pack":
    parts = pack(root, planned_runs(root, runs, args.two_stage), args.carry.resolve(),
                 args.part_mib, args.most_mib)
    print(f"packed into {len(parts)} parts of at most {args.part_mib:g} MiB: "
          + " ".join(str(p) for p in parts), flush=True)
  elif args.command == "unpack":
    names = unpack(root, args.carry.resolve())
    print(f"unpacked {len(names)} runs under {root}: {', '.join(names)}", flush=True)
  elif args.command == "list":
    for run in planned_runs(root, runs, args.two_stage):
      print(run.name, "finished" if is_finished(root, run) else "")
  elif args.command == "status":
    print(format_status(status(root, runs, extra, args.two_stage)))
  elif args.command == "run":
    root.mkdir(parents=True, exist_ok=True)
    if args.gpus:
      gpus = args.gpus.split(",")
      with mps_daemon(args.mps):
        workers = []
        for i, gpu in enumerate(gpus):
          command = [sys.executable, "-m", "benchmarks.mqar.sweep", "run", f"--root={root}",
                     f"--models={','.join(mixers)}", f"--settings={args.settings}",
                     f"--lrs={args.lrs}", f"--seeds={args.seeds}",
                     f"--shard={i}/{len(gpus)}"]
          command += [f"--{k}={v}" for k, v in extra.items()]
          command += ["--two_stage"] if args.two_stage else []
          if args.time_budget is not None:
            command.append(f"--time_budget={args.time_budget}")
          workers.append(subprocess.Popen(command, env=worker_env(gpu, gpus)))
        # SIGTERM: the workers checkpoint and exit (`timeout` signals them too). Ctrl-C
        # reaches the workers through the terminal's process group; this process waits.
        signal.signal(signal.SIGTERM, lambda *_: [w.terminate() for w in workers])
        signal.signal(signal.SIGINT, lambda *_: None)
        codes = [w.wait() for w in workers]
      if BUDGET_EXIT in codes and set(codes) <= {0, BUDGET_EXIT}:
        raise SystemExit(BUDGET_EXIT)  # some workers stopped by the budget, none failed
      if any(codes):
        raise SystemExit(f"worker exit codes: {codes}")
    else:
      train_cells(root, runs, shard(list(cells(runs)), args.shard), extra,
                  args.two_stage, args.time_budget)
  else:
    report(root, None if args.no_record else args.records or root,
           results_lib.command_line("benchmarks.mqar.sweep", sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
  main()

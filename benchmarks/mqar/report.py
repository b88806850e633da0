"""The MQAR sweep's results: each run's outcome, the best-lr statistics, tables and plots.

`collect` reads every run under a sweep root (benchmarks/mqar/sweep.py: one workdir per run,
the files of a train.py run); the rest turns those per-run dicts into the report that
`mqar/sweep.py collect` prints, saves (results.json) and plots, and into the run table of
its record (benchmarks/results.py; rendered into docs/results/mqar.md).
"""

import json
import pathlib

from benchmarks import results as results_lib
from palimpsa_jax.models import registry
from palimpsa_jax.run_config import config_args
from palimpsa_jax.training import metrics as metrics_lib


def _color(mixer: str) -> str | None:
  """The mixer's colour in plots (None, matplotlib's next, for a name the registry lacks)."""
  return registry.MIXERS[mixer].color if mixer in registry.MIXERS else None


def read_run_metrics(workdir: pathlib.Path) -> list[dict[str, object]]:
  """The run's metrics.jsonl records; none before its first log step."""
  if not (workdir / "metrics.jsonl").exists():
    return []
  return metrics_lib.read_metrics(str(workdir))


def _progress_from_metrics(workdir: pathlib.Path) -> dict[str, object]:
  """Summary-like fields of a run stopped before its summary: from metrics.jsonl."""
  best, best_step, last_step = None, None, 0
  for record in read_run_metrics(workdir):
    last_step = max(last_step, record["step"])
    accuracy = record.get("eval/accuracy")
    if accuracy is not None and (best is None or accuracy > best):
      best, best_step = accuracy, record["step"]
  return {"best_accuracy": best, "best_step": best_step, "final_step": last_step,
          "stopped_early": False, "wall_time_s": None}


def mqar_mixer(config: dict[str, object]) -> str | None:
  """The mixer of a run's saved config.json, or None if it is not an MQAR run of configs/mqar.py
  (e.g. a language-model run)."""
  if config.get("task", "mqar") != "mqar":
    return None
  return config_args.upgrade_args(config.get("args") or {}).get("model")


def collect(root: pathlib.Path) -> list[dict[str, object]]:
  """One record per MQAR run started under root: its grid point and summary.

  A run without summary.json (stopped before the end, e.g. by a time limit)
  gets "finished": False and its best evaluation so far from metrics.jsonl. Other runs
  (not of configs/mqar.py) are left out, named in one line.
  """
  records, skipped = [], []
  for config_path in sorted(root.glob("*/config.json")):
    workdir = config_path.parent
    config = json.loads(config_path.read_text())
    mixer = mqar_mixer(config)
    if mixer is None:
      skipped.append(workdir.name)
      continue
    args = config_args.upgrade_args(config["args"])
    finished = (workdir / "summary.json").exists()
    summary = (json.loads((workdir / "summary.json").read_text()) if finished
               else _progress_from_metrics(workdir))
    records.append({
        "name": workdir.name, "mixer": mixer,
        "seq_len": args["seq_len"], "kv": args["num_kv_pairs"], "lr": args["learning_rate"],
        "seed": args["seed"], "epochs": args["num_epochs"],
        "examples": args["num_train_examples"], "batch": args.get("batch_size"),
        "finished": finished, "best_accuracy": summary["best_accuracy"],
        "best_step": summary["best_step"], "final_step": summary["final_step"],
        "stopped_early": summary["stopped_early"],
        "wall_time_s": summary["wall_time_s"], "error": summary.get("error")})
  if skipped:
    print(f"skipped {len(skipped)} folder(s) under {root} that hold no MQAR run: "
          f"{', '.join(skipped)}")
  return records


def format_runs(records: list[dict[str, object]]) -> str:
  """Every run: lr, best accuracy, steps done, whether it finished."""
  lines = ["| run | best accuracy | at step | steps done | finished |",
           "|---|---|---|---|---|"]
  for r in records:
    accuracy = "n/a" if r["best_accuracy"] is None else f"{100 * r['best_accuracy']:.2f}%"
    state = ("early stop" if r["stopped_early"] else "yes") if r["finished"] else "no"
    lines.append(f"| {r['name']} | {accuracy} | {r['best_step']} | {r['final_step']} "
                 f"| {state} |")
  return "\n".join(lines)


def best_lr_statistics(records: list[dict[str, object]]) -> list[dict[str, object]]:
  """Per (mixer, seq_len, kv): mean and std over seeds of the best-lr accuracy.

  Runs not evaluated yet are left out; a cell without an evaluated run has no row.
  """
  best: dict[tuple, dict[int, dict]] = {}
  for r in records:
    if r["best_accuracy"] is None:
      continue
    per_seed = best.setdefault((r["mixer"], r["seq_len"], r["kv"]), {})
    accuracy = r["best_accuracy"]
    if r["seed"] not in per_seed or accuracy > per_seed[r["seed"]]["accuracy"]:
      per_seed[r["seed"]] = {"accuracy": accuracy, "lr": r["lr"]}
  rows = []
  for (mixer, seq_len, kv), per_seed in sorted(best.items()):
    values = [v["accuracy"] for v in per_seed.values()]
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    rows.append({"mixer": mixer, "seq_len": seq_len, "kv": kv, "mean": mean,
                 "std": std, "seeds": len(values),
                 "best_lrs": {str(s): v["lr"] for s, v in sorted(per_seed.items())}})
  return rows


def plot(rows: list[dict[str, object]], path: pathlib.Path) -> None:
  """Accuracy vs sequence length, one line per mixer, error bars over seeds."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  for mixer in dict.fromkeys(r["mixer"] for r in rows):
    points = sorted((r["seq_len"], r["mean"], r["std"]) for r in rows
                    if r["mixer"] == mixer)
    xs, means, stds = zip(*points)
    ax.errorbar(xs, [100 * m for m in means], yerr=[100 * s for s in stds],
                marker="o", capsize=3, label=registry.label(mixer), color=_color(mixer))
  ax.set_xscale("log", base=2)
  ax.set_xticks(sorted({r["seq_len"] for r in rows}))
  ax.set_xticklabels([f"{r['seq_len']}\n({r['kv']} kv)" for r in
                      sorted({(r["seq_len"], r["kv"]): r for r in rows}.values(),
                             key=lambda r: r["seq_len"])])
  ax.set_xlabel("sequence length (key-value pairs)")
  ax.set_ylabel("MQAR accuracy (%), best lr per seed")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_curves(root: pathlib.Path, records: list[dict[str, object]],
                path: pathlib.Path) -> None:
  """Test accuracy against training step for every run (one panel per setting)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  settings = sorted({(r["seq_len"], r["kv"]) for r in records})
  fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4), squeeze=False)
  for ax, (seq_len, kv) in zip(axes[0], settings):
    for r in records:
      if (r["seq_len"], r["kv"]) != (seq_len, kv):
        continue
      points = [(rec["step"], rec["eval/accuracy"])
                for rec in read_run_metrics(root / r["name"]) if "eval/accuracy" in rec]
      if not points:
        continue
      steps, accuracies = zip(*points)
      lrs = sorted({x["lr"] for x in records if x["mixer"] == r["mixer"]})
      style = ["-", "--", ":", "-."][lrs.index(r["lr"]) % 4]
      ax.plot(steps, [100 * a for a in accuracies], style, color=_color(r["mixer"]),
              label=f"{registry.label(r['mixer'])} lr {r['lr']:g} s{r['seed']}")
    ax.set_title(f"L={seq_len}, {kv} kv pairs")
    ax.set_xlabel("training step")
    ax.set_ylabel("MQAR test accuracy (%)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def format_table(rows: list[dict[str, object]]) -> str:
  lines = ["| mixer | seq_len | kv | accuracy (mean +- std) | seeds | best lr per seed |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    lrs = ", ".join(f"{lr:g}" for lr in r["best_lrs"].values())
    lines.append(f"| {registry.label(r['mixer'])} | {r['seq_len']} | {r['kv']} | "
                 f"{100 * r['mean']:.2f} +- {100 * r['std']:.2f} | {r['seeds']} | {lrs} |")
  return "\n".join(lines)


def runs_table(runs: list[dict[str, object]]) -> str:
  """The record's table: one row per run, its grid point, schedule and outcome."""
  lines = ["| mixer | seq_len | kv | lr | seed | epochs | examples | best accuracy | at step "
           "| steps done | finished |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in runs:
    accuracy = "n/a" if r["best_accuracy"] is None else f"{100 * r['best_accuracy']:.2f}%"
    state = ("early stop" if r["stopped_early"] else "yes") if r["finished"] else "no"
    lines.append(f"| {r['mixer']} | {r['seq_len']} | {r['kv']} | {r['lr']:g} | {r['seed']} "
                 f"| {r['epochs']} | {r['examples']} | {accuracy} | {r['best_step'] or '-'} "
                 f"| {r['final_step']} | {state} |")
  return "\n".join(lines)


COLLECTED = ("best test accuracy of each run (unfinished runs: their best evaluation so far); "
             "the device is the one `collect` ran on (run it where the runs trained)")


def make_record(root_name: str, runs: list[dict[str, object]], command: str,
                notes: list[str] = (COLLECTED,), **device) -> dict[str, object]:
  """The sweep's record of its collected runs; `device`: results.make_record's date, device,
  num_devices, backend and versions, where they are not this process's."""
  return results_lib.make_record(
      "mqar_sweep", f"MQAR sweep: {len(runs)} runs under {root_name}", command,
      settings={"seq_len_kv": sorted({(r["seq_len"], r["kv"]) for r in runs}),
                "epochs": sorted({r["epochs"] for r in runs}),
                "examples": sorted({r["examples"] for r in runs})},
      notes=notes, table=runs_table(runs), **device)


def report(root: pathlib.Path, records_dir: pathlib.Path | str | None, command: str) -> None:
  """Collects the runs under root; writes results.json, accuracy.png, accuracy_vs_step.png
  there, prints the tables and writes the sweep's record to records_dir (None: none)."""
  records = collect(root)
  if not records:
    raise SystemExit(f"no MQAR runs under {root}.")
  rows = best_lr_statistics(records)
  (root / "results.json").write_text(json.dumps(
      {"runs": records, "best_lr": rows}, indent=2))
  plot(rows, root / "accuracy.png")
  plot_curves(root, records, root / "accuracy_vs_step.png")
  print(format_runs(records))
  print(format_table(rows))
  print(f"wrote {root / 'results.json'}, {root / 'accuracy.png'} and "
        f"{root / 'accuracy_vs_step.png'}")
  if records_dir is not None:
    # A run not evaluated yet measured nothing: it must not replace an older row of the run.
    evaluated = [r for r in records if r["best_accuracy"] is not None]
    waiting = [r["name"] for r in records if r["best_accuracy"] is None]
    notes = [COLLECTED] + ([f"not evaluated yet, left out: {', '.join(waiting)}"]
                           if waiting else [])
    if not evaluated:
      print("no run has been evaluated yet: no record")
      return
    record = make_record(root.name, evaluated, command, notes)
    print(f"wrote {results_lib.write_record(record, records_dir)}")

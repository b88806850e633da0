"""The MQAR sweep launcher: grid, shards, skipping, collection and the plot (fake runs)."""

import importlib.util
import json
import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location(
    "mqar_sweep", REPO / "benchmarks" / "mqar_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def _fake_run(root, run, accuracy):
  workdir = root / run.name
  workdir.mkdir(parents=True)
  args = {"mixer": run.mixer, "seq_len": run.seq_len, "kv": run.kv, "lr": run.lr,
          "seed": run.seed, "epochs": 2, "examples": 1000}
  (workdir / "config.json").write_text(json.dumps({"args": args}))
  (workdir / "summary.json").write_text(json.dumps(
      {"best_accuracy": accuracy, "best_step": 10, "final_step": 20,
       "stopped_early": False, "wall_time_s": 1.0}))


def test_grid_and_shards():
  runs = sweep.grid()
  assert len(runs) == 5 * 2 * 4 * 3 == len({r.name for r in runs})
  shards = [sweep.shard(runs, f"{i}/3") for i in range(3)]
  assert sorted(r.name for s in shards for r in s) == sorted(r.name for r in runs)
  arg = runs[0].config_arg({"epochs": 4})
  assert arg.startswith("preset=paper,mixer=palimpsa_d,seq_len=512,kv=128,lr=0.001")
  assert arg.endswith("epochs=4")
  with pytest.raises(ValueError, match="i/n"):
    sweep.shard(runs, "3")


def test_collect_best_lr_statistics_and_plot(tmp_path):
  runs = sweep.grid(mixers=("palimpsa_d", "mamba2"), lrs=(1e-3, 1e-2), seeds=(0, 1))
  for run in runs:
    accuracy = {1e-3: 0.5, 1e-2: 0.9}[run.lr] if run.mixer == "palimpsa_d" else (
        0.4 + 0.1 * run.seed)
    if run.seq_len == 1024:
      accuracy -= 0.2
    _fake_run(tmp_path, run, accuracy)
  assert sweep.is_finished(tmp_path, runs[0])
  sweep.main(["collect", "--root", str(tmp_path)])
  results = json.loads((tmp_path / "results.json").read_text())
  assert len(results["runs"]) == len(runs)
  rows = {(r["mixer"], r["seq_len"]): r for r in results["best_lr"]}
  assert rows[("palimpsa_d", 512)]["mean"] == pytest.approx(0.9)
  assert rows[("palimpsa_d", 512)]["std"] == pytest.approx(0.0)
  assert rows[("palimpsa_d", 512)]["best_lrs"] == {"0": 1e-2, "1": 1e-2}
  assert rows[("mamba2", 1024)]["mean"] == pytest.approx(0.25)
  assert rows[("mamba2", 1024)]["std"] == pytest.approx(0.05)
  assert (tmp_path / "accuracy.png").read_bytes()[:4] == b"\x89PNG"


def test_collect_reports_unfinished_runs_from_metrics(tmp_path, capsys):
  finished, stopped = sweep.grid(mixers=("mamba2",), settings=((512, 128),),
                                 lrs=(1e-3, 1e-2), seeds=(0,))
  _fake_run(tmp_path, finished, 0.3)
  _fake_run(tmp_path, stopped, None)
  workdir = tmp_path / stopped.name
  (workdir / "summary.json").unlink()
  (workdir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
      {"step": 10, "train/loss": 5.0}, {"step": 20, "eval/accuracy": 0.6},
      {"step": 40, "eval/accuracy": 0.5}, {"step": 45, "train/loss": 1.0}]) + "\n")
  assert not sweep.is_finished(tmp_path, stopped)
  sweep.main(["collect", "--root", str(tmp_path)])
  runs = {r["lr"]: r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
  assert runs[1e-2]["finished"] is False
  assert (runs[1e-2]["best_accuracy"], runs[1e-2]["best_step"],
          runs[1e-2]["final_step"]) == (0.6, 20, 45)
  assert runs[1e-3]["finished"] is True
  printed = capsys.readouterr().out
  assert f"| {stopped.name} | 60.00% | 20 | 45 | no |" in printed
  assert (tmp_path / "accuracy_vs_step.png").read_bytes()[:4] == b"\x89PNG"


def test_run_skips_finished(tmp_path, capsys):
  (run,) = sweep.grid(mixers=("mamba2",), settings=((512, 128),), lrs=(1e-3,), seeds=(0,))
  _fake_run(tmp_path, run, 0.5)
  sweep.run_shard(tmp_path, [run], {})
  assert "finished, skipped" in capsys.readouterr().out


def test_workers_sharing_a_gpu_allocate_on_demand(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  gpus = ["0", "0", "1"]
  shared, alone = sweep.worker_env("0", gpus), sweep.worker_env("1", gpus)
  assert shared["CUDA_VISIBLE_DEVICES"] == "0" and alone["CUDA_VISIBLE_DEVICES"] == "1"
  assert shared["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in alone


def test_mps_needs_the_control_binary(monkeypatch):
  monkeypatch.setattr(sweep.shutil, "which", lambda name: None)
  with pytest.raises(SystemExit, match="nvidia-cuda-mps-control"):
    with sweep.mps_daemon(True):
      pass


def test_mps_daemon_starts_and_quits(tmp_path, monkeypatch):
  log = tmp_path / "calls.txt"
  fake = tmp_path / "nvidia-cuda-mps-control"
  fake.write_text(f'#!/bin/sh\necho "args:$*" >> {log}\ncat >> {log}\n')
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
  with sweep.mps_daemon(True):
    assert log.read_text().startswith("args:-d")
  assert log.read_text().splitlines()[-2:] == ["args:", "quit"]

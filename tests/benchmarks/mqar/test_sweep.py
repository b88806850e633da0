"""The MQAR sweep launcher: grid, shards, skipping, collection and the plot (fake runs)."""

import json
import os
import signal

import pytest

from benchmarks.mqar import report as mqar_sweep_report
from benchmarks.mqar import sweep
from palimpsa_jax.training import bookkeeping
from tests.training import tiny_lm


def _fake_run(root, run, accuracy):
  workdir = root / run.name
  workdir.mkdir(parents=True)
  args = {"mixer": run.mixer, "seq_len": run.seq_len, "num_kv_pairs": run.kv,
          "learning_rate": run.lr, "seed": run.seed, "num_epochs": 2,
          "num_train_examples": 1000}
  (workdir / "config.json").write_text(json.dumps({"args": args}))
  (workdir / "summary.json").write_text(json.dumps(
      {"best_accuracy": accuracy, "best_step": 10, "final_step": 20,
       "stopped_early": False, "wall_time_s": 1.0}))


def test_grid_and_shards():
  runs = sweep.grid()
  assert len(runs) == 5 * 2 * 4 * 3 == len({r.name for r in runs})
  shards = [sweep.shard(runs, f"{i}/3") for i in range(3)]
  assert sorted(r.name for s in shards for r in s) == sorted(r.name for r in runs)
  arg = runs[0].config_arg({"num_epochs": 4})
  assert arg.startswith(
      "preset=paper,model=palimpsa_d,seq_len=512,num_kv_pairs=128,learning_rate=0.001")
  assert arg.endswith("num_epochs=4")
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
  sweep.main(["collect", "--root", str(tmp_path), "--no_record"])
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
  sweep.main(["collect", "--root", str(tmp_path), "--no_record"])
  runs = {r["lr"]: r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
  assert runs[1e-2]["finished"] is False
  assert (runs[1e-2]["best_accuracy"], runs[1e-2]["best_step"],
          runs[1e-2]["final_step"]) == (0.6, 20, 45)
  assert runs[1e-3]["finished"] is True
  printed = capsys.readouterr().out
  assert f"| {stopped.name} | 60.00% | 20 | 45 | no |" in printed
  assert (tmp_path / "accuracy_vs_step.png").read_bytes()[:4] == b"\x89PNG"


def test_collect_leaves_runs_without_an_evaluation_out_of_the_statistics(tmp_path):
  evaluated, fresh = sweep.grid(mixers=("mamba2", "palimpsa_d"), settings=((512, 128),),
                                lrs=(1e-3,), seeds=(0,))
  _fake_run(tmp_path, evaluated, 0.3)
  _fake_run(tmp_path, fresh, None)
  workdir = tmp_path / fresh.name
  (workdir / "summary.json").unlink()
  (workdir / "metrics.jsonl").write_text(json.dumps({"step": 78, "train/loss": 9.0}) + "\n")
  sweep.main(["collect", "--root", str(tmp_path), "--no_record"])
  results = json.loads((tmp_path / "results.json").read_text())
  assert [r["mixer"] for r in results["best_lr"]] == ["mamba2"]
  assert {r["mixer"]: r["best_accuracy"] for r in results["runs"]} == {
      "mamba2": 0.3, "palimpsa_d": None}


def _write_summary(root, run, accuracy, best_step, final_step=20):
  (root / run.name / "summary.json").write_text(json.dumps(
      {"best_accuracy": accuracy, "best_step": best_step, "final_step": final_step,
       "stopped_early": False, "wall_time_s": 1.0}))


def test_two_stage_runs_later_seeds_at_each_cells_best_lr(tmp_path):
  runs = sweep.grid(mixers=("mamba2", "palimpsa_d"), settings=((512, 128),),
                    lrs=(1e-3, 1e-2), seeds=(0, 1, 2))
  first = sweep.planned_runs(tmp_path, runs, two_stage=True)
  assert [(r.mixer, r.lr, r.seed) for r in first] == [
      ("mamba2", 1e-3, 0), ("mamba2", 1e-2, 0), ("palimpsa_d", 1e-3, 0),
      ("palimpsa_d", 1e-2, 0)]
  for run, accuracy, step in zip(first, (0.5, 0.7, 0.9, 0.9), (10, 10, 30, 20)):
    (tmp_path / run.name).mkdir()
    if run.mixer == "mamba2" or run.lr == 1e-2:
      _write_summary(tmp_path, run, accuracy, step)
  later_seeds = lambda: [(r.mixer, r.lr, r.seed) for r in
                         sweep.planned_runs(tmp_path, runs, two_stage=True) if r.seed]
  assert later_seeds() == [("mamba2", 1e-2, 1), ("mamba2", 1e-2, 2)]
  _write_summary(tmp_path, first[2], 0.9, 30)  # a tie: the earlier best wins
  assert later_seeds()[2:] == [("palimpsa_d", 1e-2, 1), ("palimpsa_d", 1e-2, 2)]
  assert sweep.planned_runs(tmp_path, runs, two_stage=False) == runs


def test_status_counts_runs_steps_and_gpu_time_left(tmp_path, capsys):
  # The unmeasured cell first: it borrows the rate of a later one.
  runs = sweep.grid(mixers=("palimpsa_d", "mamba2"), settings=((512, 128),),
                    lrs=(1e-3, 1e-2), seeds=(0,))
  extra = {"num_train_examples": 1280, "num_epochs": 10}  # 100 steps per run
  done, running = runs[2:]
  (tmp_path / done.name).mkdir()
  _write_summary(tmp_path, done, 0.99, 40, final_step=40)
  (tmp_path / running.name / "checkpoints" / "30").mkdir(parents=True)
  (tmp_path / running.name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
      {"step": 30, "perf/steps_per_sec": 0.02}, {"step": 35, "perf/steps_per_sec": 0.01}]))
  rows = {r["mixer"]: r for r in sweep.status(tmp_path, runs, extra, two_stage=False)}
  mamba2, palimpsa = rows["mamba2"], rows["palimpsa_d"]
  assert (mamba2["finished"], mamba2["running"], mamba2["left"]) == (1, 1, 0)
  assert (mamba2["steps_done"], mamba2["steps_planned"]) == (75, 140)
  assert mamba2["gpu_hours_left"] == pytest.approx(65 / 0.02 / 3600)
  assert (palimpsa["left"], palimpsa["steps_planned"]) == (2, 200)
  assert not palimpsa["rate_measured"]  # borrowed from mamba2 at the same setting
  assert palimpsa["gpu_hours_left"] == pytest.approx(100 / 0.02 / 3600)
  sweep.main(["status", "--root", str(tmp_path), "--models", "palimpsa_d,mamba2",
              "--settings", "512:128", "--lrs", "1e-3,1e-2", "--seeds", "0",
              "--examples", "1280", "--epochs", "10"])
  assert "runs: 1 finished, 1 running, 2 left; steps 75 of 340" in capsys.readouterr().out
  two_stage = sweep.status(tmp_path, sweep.grid(
      mixers=("mamba2",), settings=((512, 128),), lrs=(1e-3, 1e-2), seeds=(0, 1, 2)),
      extra, two_stage=True)
  assert (two_stage[0]["left"], two_stage[0]["steps_planned"]) == (2, 340)
  # Seeds 1 and 2 follow the first seed's runs: 65 + 100 steps at 0.02 steps/s.
  assert two_stage[0]["gpu_hours_left"] == pytest.approx(165 / 0.02 / 3600)


def test_run_trains_both_stages_resumes_and_skips(tmp_path, monkeypatch, capsys):
  tiny_lm.use_tiny_model(monkeypatch)
  def tiny_config(run, extra):
    del extra
    return tiny_lm.tiny_mqar_config(**{
        "optimizer.learning_rate": run.lr, "seed": run.seed, "args.learning_rate": run.lr,
        "args.seed": run.seed, "args.model": run.mixer})
  monkeypatch.setattr(sweep, "run_config", tiny_config)
  args = ["--root", str(tmp_path), "--models", "mamba2", "--settings", "512:128",
          "--lrs", "1e-2,3e-2", "--seeds", "0,1", "--two_stage"]
  polls = []
  monkeypatch.setattr(bookkeeping.StopSignals, "__call__", lambda self: len(polls) > 4
                      or polls.append(None))
  with pytest.raises(SystemExit) as stopped:  # after 5 steps: checkpointed, no summaries
    sweep.main(["run", *args])
  assert stopped.value.code == 130
  runs = sweep.grid(mixers=("mamba2",), settings=((512, 128),), lrs=(1e-2, 3e-2),
                    seeds=(0,))
  assert [sweep.latest_checkpoint(tmp_path / r.name) for r in runs] == [5, 5]
  assert not any(sweep.is_finished(tmp_path, r) for r in runs)
  monkeypatch.setattr(bookkeeping.StopSignals, "__call__", lambda self: False)
  sweep.main(["run", *args])
  out = capsys.readouterr().out
  assert "2 runs (lr 0.01 s0, lr 0.03 s0) from step 5" in out
  records = json.loads(json.dumps(mqar_sweep_report.collect(tmp_path)))
  assert sorted((r["lr"], r["seed"], r["finished"]) for r in records)[:2] == [
      (0.01, 0, True), (0.03, 0, True)]
  assert len(records) == 3 and all(r["finished"] for r in records)
  assert records[0]["final_step"] == 32
  sweep.main(["run", *args])
  assert "runs (" not in capsys.readouterr().out  # nothing left to train


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_sets_the_stop_request_until_closed(signum):
  previous = signal.getsignal(signum)
  with bookkeeping.StopSignals() as stop:
    assert not stop()
    os.kill(os.getpid(), signum)
    assert stop() and stop.exit_code == 128 + signum
  assert signal.getsignal(signum) is previous


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


def _tiny_sweep(monkeypatch):
  """A one-run sweep of TinyLM: 16 steps, a checkpoint every 4; the `run` arguments."""
  tiny_lm.use_tiny_model(monkeypatch)
  monkeypatch.setattr(sweep, "run_config", lambda run, extra: tiny_lm.resumable_mqar_config(
      16, **{"optimizer.learning_rate": run.lr, "seed": run.seed,
             "args.learning_rate": run.lr, "args.seed": run.seed, "args.model": run.mixer}))
  return ["--models", "mamba2", "--settings", "512:128", "--lrs", "1e-2", "--seeds", "0"]


def _run_records(root):
  """The run's logged records without its timings (perf/), and its summary's outcome."""
  (workdir,) = [p for p in root.iterdir() if p.is_dir()]
  records = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
             for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  summary = json.loads((workdir / "summary.json").read_text())
  return ([r for r in records if len(r) > 1],
          {k: summary[k] for k in ("best_accuracy", "best_step", "final_step")})


def test_a_run_stopped_by_its_time_budget_resumes_in_another_slot(tmp_path, monkeypatch,
                                                                  capsys):
  """Stopped by --time_budget after 5 steps, packed, unpacked under a fresh root (the next
  slot's machine) and resumed: the same records and outcome as one uninterrupted run."""
  args = _tiny_sweep(monkeypatch)
  sweep.main(["run", "--root", str(tmp_path / "whole"), *args])
  polls = []
  monkeypatch.setattr(sweep.TimeBudget, "__call__", lambda self: len(polls) > 4
                      or polls.append(None))
  first = tmp_path / "first_slot"
  with pytest.raises(SystemExit) as stopped:
    sweep.main(["run", "--root", str(first), "--time_budget", "8", *args])
  assert stopped.value.code == sweep.BUDGET_EXIT
  assert "time budget of 8 minutes is spent" in capsys.readouterr().err
  (run,) = sweep.grid(("mamba2",), ((512, 128),), (1e-2,), (0,))
  assert sorted(p.name for p in (first / run.name / "checkpoints").iterdir()) == ["4", "5"]

  carry = tmp_path / "carry"
  sweep.main(["pack", "--root", str(first), "--carry", str(carry), "--part_mib", "0.01",
              *args])
  parts = sorted(carry.iterdir())
  assert len(parts) > 1 and all(p.stat().st_size <= 0.01 * 2**20 for p in parts)
  second = tmp_path / "second_slot"
  sweep.main(["unpack", "--root", str(second), "--carry", str(carry)])
  assert sweep.latest_checkpoint(second / run.name) == 5
  assert not (second / run.name / "checkpoints" / "4").exists()  # only the latest travels
  monkeypatch.setattr(sweep.TimeBudget, "__call__", lambda self: False)
  sweep.main(["run", "--root", str(second), "--time_budget", "8", *args])
  assert "1 runs (lr 0.01 s0) from step 5" in capsys.readouterr().out
  assert _run_records(second) == _run_records(tmp_path / "whole")
  with pytest.raises(SystemExit, match="holds checkpoint 16, later than the carried 5"):
    sweep.main(["unpack", "--root", str(second), "--carry", str(carry)])  # an older carry
  assert _run_records(second) == _run_records(tmp_path / "whole")


def test_pack_refuses_more_than_can_be_carried(tmp_path, monkeypatch, capsys):
  args = _tiny_sweep(monkeypatch)
  sweep.main(["run", "--root", str(tmp_path / "runs"), *args])
  with pytest.raises(SystemExit, match=r"more than --most_mib 0.001"):
    sweep.main(["pack", "--root", str(tmp_path / "runs"), "--carry", str(tmp_path / "c"),
                "--most_mib", "0.001", *args])
  with pytest.raises(SystemExit, match="no run of the grid"):
    sweep.main(["pack", "--root", str(tmp_path / "none"), "--carry", str(tmp_path / "c"),
                *args])
  with pytest.raises(SystemExit) as refused:
    sweep.main(["pack", "--root", str(tmp_path / "runs"), "--carry", str(tmp_path / "c"),
                "--part_mib", "0", *args])
  assert refused.value.code == 2
  assert "--part_mib must be positive, got 0" in capsys.readouterr().err
  with pytest.raises(SystemExit, match="no sweep_carry.tar.NN parts"):
    sweep.main(["unpack", "--root", str(tmp_path / "r"), "--carry", str(tmp_path / "c")])


def test_the_time_budget_expires_after_its_minutes(monkeypatch):
  now = [100.0]
  monkeypatch.setattr(sweep.time, "monotonic", lambda: now[0])
  budget, never = sweep.TimeBudget(2), sweep.TimeBudget(None)
  now[0] += 119
  assert not budget() and not never()
  now[0] += 1
  assert budget() and not never()

"""benchmarks/mqar/report.py: collect's record of the runs, and its view in the docs."""

import json

from benchmarks import render_records
from benchmarks import results as results_lib
from benchmarks.mqar import sweep as mqar_sweep


def _fake_run(root, name, mixer, lr, seed, accuracy, final_step, epochs=60, finished=False):
  workdir = root / name
  workdir.mkdir(parents=True)
  # The argument names of earlier versions (kv, lr, ...), as the recorded sweeps hold them.
  args = {"mixer": mixer, "seq_len": 512, "kv": 128, "lr": lr, "seed": seed,
          "epochs": epochs, "examples": 100000}
  (workdir / "config.json").write_text(json.dumps({"args": args}))
  if finished:
    (workdir / "summary.json").write_text(json.dumps(
        {"best_accuracy": accuracy, "best_step": final_step, "final_step": final_step,
         "stopped_early": True, "wall_time_s": 1.0}))
  else:
    (workdir / "metrics.jsonl").write_text(
        json.dumps({"step": final_step, "eval/accuracy": accuracy}) + "\n")


def _collect(tmp_path, name, runs):
  root = tmp_path / name
  for run in runs:
    _fake_run(root, *run)
  before = set((tmp_path / "records").glob("*.json"))
  mqar_sweep.main(["collect", "--root", str(root), "--records", str(tmp_path / "records")])
  (path,) = set((tmp_path / "records").glob("mqar_sweep_*.json")) - before
  return json.loads(path.read_text())


def test_collect_records_every_run_and_the_view_takes_the_newest(tmp_path):
  record = _collect(tmp_path, "first", [
      ("a", "palimpsa_d", 1e-3, 0, 0.5, 100), ("b", "palimpsa_d", 1e-2, 0, 0.9, 120),
      ("c", "mamba2", 1e-3, 0, 0.25, 200, 60, True), ("d", "mamba2", 1e-3, 1, 0.75, 220),
      ("e", "mamba2", 1e-2, 0, 0.125, 180, 3), ("f", "mesanet", 1e-3, 0, 0.5, 100)])
  assert record["benchmark"] == "mqar_sweep" and "collect --root" in record["command"]
  assert record["settings"] == {"seq_len_kv": [[512, 128]], "epochs": [3, 60],
                                "examples": [100000]}
  assert record["table"]["rows"][0] == ["palimpsa_d", "512", "128", "0.001", "0", "60",
                                        "100000", "50.00%", "100", "100", "no"]
  table = render_records.mqar_paper(results_lib.load_records(tmp_path / "records"))
  lines = table.splitlines()
  assert lines[0] == ("| mixer | L, kv pairs | lr 1e-3 | lr 1e-2 | steps done | runs finished "
                      "| measured |")
  # Palimpsa-D before Mamba2 (the sweep's order); the 3-epoch run is not the paper's.
  assert lines[2].startswith("| Palimpsa-D | 512, 128 | 50.00% (step 100) | "
                             "**90.00%** (step 120) | 100 / 120 | 0 of 2 |")
  assert lines[3].startswith("| Mamba2 | 512, 128 | **50.00%** (2 seeds) | - | 200 / 220 "
                             "| 1 of 2 |")
  assert lines[4].startswith("| MesaNet | 512, 128 |")  # in the registry's order: last here
  # A later collect of one run replaces that run only.
  _collect(tmp_path, "later", [("b", "palimpsa_d", 1e-2, 0, 0.25, 300)])
  table = render_records.mqar_paper(results_lib.load_records(tmp_path / "records"))
  assert "| Palimpsa-D | 512, 128 | **50.00%** (step 100) | 25.00% (step 300) |" in table


def test_no_record_writes_none(tmp_path):
  _fake_run(tmp_path / "sweep", "a", "mamba2", 1e-3, 0, 0.5, 100)
  mqar_sweep.main(["collect", "--root", str(tmp_path / "sweep"), "--no_record",
                   "--records", str(tmp_path / "records")])
  assert not (tmp_path / "records").exists()


def test_the_record_leaves_out_runs_not_evaluated_yet(tmp_path):
  root = tmp_path / "sweep"
  _fake_run(root, "a", "palimpsa_d", 1e-3, 0, 0.5, 100)
  fresh = root / "b"
  fresh.mkdir()
  (fresh / "config.json").write_text(json.dumps({"args": {
      "mixer": "mamba2", "seq_len": 512, "kv": 128, "lr": 1e-3, "seed": 0, "epochs": 60,
      "examples": 100000}}))
  (fresh / "metrics.jsonl").write_text(json.dumps({"step": 78, "train/loss": 9.0}) + "\n")
  mqar_sweep.main(["collect", "--root", str(root), "--records", str(tmp_path / "records")])
  (record,) = results_lib.load_records(tmp_path / "records")
  assert [row[0] for row in record["table"]["rows"]] == ["palimpsa_d"]
  assert record["notes"][-1] == "not evaluated yet, left out: b"


def test_a_users_collect_keeps_its_record_beside_the_runs_and_skips_other_runs(tmp_path,
                                                                             capsys):
  root = tmp_path / "mine"
  _fake_run(root, "a", "palimpsa_d", 1e-3, 0, 0.5, 100)
  lm = root / "lm_run"
  lm.mkdir()
  (lm / "config.json").write_text(json.dumps({"task": "lm", "args": {"model": "palimpsa_d"}}))
  records_before = sorted(results_lib.RECORDS.glob("*.json"))
  mqar_sweep.main(["collect", "--root", str(root)])
  assert sorted(results_lib.RECORDS.glob("*.json")) == records_before
  (path,) = root.glob("mqar_sweep_*.json")
  record = json.loads(path.read_text())
  assert [row[0] for row in record["table"]["rows"]] == ["palimpsa_d"]
  assert (f"skipped 1 folder(s) under {root} that hold no MQAR run: lm_run"
          in capsys.readouterr().out.splitlines())

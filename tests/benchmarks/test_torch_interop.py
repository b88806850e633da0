"""benchmarks/torch_interop.py: the record of a run (a result as the script builds it)."""

import argparse
import json

from benchmarks import torch_interop


def _comparison(rel, dtype):
  return {"rel_err": rel, "max_abs_err": 0.1, "max_abs_logit": 3.0,
          "threshold": torch_interop.THRESHOLDS[dtype],
          "ok": rel <= torch_interop.THRESHOLDS[dtype]}


def _result():
  palimpsa = {"num_params": 172337792}
  for direction, rels in (("ours_to_theirs", (6.35e-6, 4.88e-2)),
                          ("theirs_to_ours", (2.39e-5, 4.78e-2))):
    palimpsa |= {f"{direction}_float32": _comparison(rels[0], "float32"),
                 f"{direction}_bfloat16": _comparison(rels[1], "bfloat16"),
                 f"{direction}_bfloat16_vs_float32": {"ours": 3.67e-2, "theirs": 4.31e-2}}
  return {"device": "NVIDIA H200", "torch": "2.11.0", "transformers": "5.17.0", "fla": "0.6.0",
          "compat": ["wandb: stub module (run=None)"], "palimpsa": palimpsa,
          "meta_mamba2": {"error": "Traceback ...\nRuntimeError: out of time\n"}}


def test_record_has_the_finished_models_rows_and_the_failures(tmp_path):
  args = argparse.Namespace(batch=2, seq_len=256, records=str(tmp_path))
  torch_interop.write_record(_result(), args, print)
  (path,) = tmp_path.glob("torch_interop_*.json")
  record = json.loads(path.read_text())
  assert record["versions"]["torch"] == "2.11.0" and record["settings"]["seq_len"] == 256
  assert record["table"]["rows"] == [
      ["Palimpsa-D 170M", "ours -> theirs", "6.35e-06", "4.88e-02 (over)",
       "3.67e-02 / 4.31e-02"],
      ["Palimpsa-D 170M", "theirs -> ours", "2.39e-05", "4.78e-02 (over)",
       "3.67e-02 / 4.31e-02"]]
  assert record["notes"] == ["Palimpsa-D 170M: 172,337,792 parameters",
                             "MetaMamba2 170M: failed (RuntimeError: out of time)",
                             "aliased for the authors' code: wandb: stub module (run=None)"]


def test_no_record_when_no_model_finished(tmp_path, capsys):
  result = _result()
  del result["palimpsa"]["ours_to_theirs_bfloat16_vs_float32"]
  del result["palimpsa"]["theirs_to_ours_bfloat16_vs_float32"]
  torch_interop.write_record(result, argparse.Namespace(batch=2, seq_len=256,
                                                        records=str(tmp_path)), print)
  assert not list(tmp_path.iterdir()) and "no record" in capsys.readouterr().out

"""The batched trainer against the single-run trainer: curves, early stop, resume."""

import importlib.util
import json
import pathlib

import pytest

from tests.training import tiny_lm
from palimpsa_jax.training import batched
from palimpsa_jax.training import bookkeeping
from palimpsa_jax.training import metrics as metrics_lib
from palimpsa_jax.training import run_summary
from palimpsa_jax.training import trainer

REPO = pathlib.Path(__file__).parents[2]
# (learning rate, seed): two seeds, one of them at two rates.
RUNS = ((1e-2, 0), (3e-2, 1), (1e-2, 1))


@pytest.fixture(autouse=True)
def _tiny_model(monkeypatch):
  tiny_lm.use_tiny_model(monkeypatch)


def _tiny_config(lr, seed, **overrides):
  return tiny_lm.tiny_mqar_config(
      **{"optimizer.learning_rate": lr, "seed": seed, "args.learning_rate": lr,
         "args.seed": seed}, **overrides)


def _curves(workdir):
  """step -> record; a resumed run's later record of a step replaces the earlier.

  The single-run trainer's start-up records (perf/ only: compile time, time to
  the first step) have no batched counterpart and are left out.
  """
  return {r["step"]: r for r in metrics_lib.read_metrics(str(workdir))
          if any(not key.startswith(("step", "perf/")) for key in r)}


def _assert_same_run(single_dir, batched_dir):
  single, group = _curves(single_dir), _curves(batched_dir)
  assert sorted(single) == sorted(group)
  for step, record in single.items():
    if "eval/accuracy" in record:
      assert group[step]["eval/accuracy"] == record["eval/accuracy"], step
      assert group[step]["eval/loss"] == pytest.approx(record["eval/loss"], rel=1e-5)
    if "train/loss" in record:
      assert group[step]["train/loss"] == pytest.approx(record["train/loss"], rel=1e-5)
      assert group[step]["train/lr"] == pytest.approx(record["train/lr"], rel=1e-6)
  summaries = [json.loads((d / run_summary.SUMMARY_FILE).read_text())
               for d in (single_dir, batched_dir)]
  for key in ("best_accuracy", "best_step", "final_step", "total_steps",
              "stopped_early", "num_params"):
    assert summaries[0][key] == summaries[1][key], key


def _train_both(tmp_path, configs):
  singles = [tmp_path / f"single{i}" for i in range(len(configs))]
  for config, workdir in zip(configs, singles):
    trainer.train_and_evaluate(config, str(workdir))
  group = [tmp_path / f"batched{i}" for i in range(len(configs))]
  batched.train_group(configs, [str(d) for d in group])
  return singles, group


def test_group_equals_each_run_alone_with_early_stops(tmp_path, capsys):
  # Chosen so that the runs end at three different steps (one at the last):
  # a stopped run is masked, then dropped from the stack.
  configs = [_tiny_config(*run, early_stop_accuracy=0.05) for run in RUNS]
  singles, group = _train_both(tmp_path, configs)
  stops = []
  for single, batch in zip(singles, group):
    _assert_same_run(single, batch)
    stops.append(json.loads((batch / run_summary.SUMMARY_FILE).read_text())["final_step"])
  assert len(set(stops)) == 3 and max(stops) == 32, stops
  assert "runs left in the stack" in capsys.readouterr().out
  for batch in group:
    assert (batch / "config.json").exists() and (batch / "checkpoints").is_dir()


def test_stopped_group_resumes_to_the_uninterrupted_result(tmp_path):
  configs = [_tiny_config(*run) for run in RUNS[:2]]
  uninterrupted = [tmp_path / f"whole{i}" for i in range(2)]
  batched.train_group(configs, [str(d) for d in uninterrupted])
  calls = []
  def stop_after_ten_steps():
    calls.append(None)
    return len(calls) > 10
  resumed = [tmp_path / f"resumed{i}" for i in range(2)]
  with pytest.raises(bookkeeping.Interrupted, match="interrupted at step 10; "):
    batched.train_group(configs, [str(d) for d in resumed], should_stop=stop_after_ten_steps)
  assert not (resumed[0] / run_summary.SUMMARY_FILE).exists()
  batched.train_group(configs, [str(d) for d in resumed])
  for whole, again in zip(uninterrupted, resumed):
    _assert_same_run(whole, again)
    summary = json.loads((again / run_summary.SUMMARY_FILE).read_text())
    segments = summary["segments"]  # the stopped segment and the one that finished
    assert [s["start_step"] for s in segments] == [0, 10], segments
    assert summary["wall_time_s"] == pytest.approx(sum(s["wall_time_s"] for s in segments))


def test_group_configs_may_differ_only_in_rate_and_seed():
  with pytest.raises(ValueError, match="data.num_kv_pairs"):
    batched.check_group([_tiny_config(1e-2, 0),
                         _tiny_config(1e-2, 1, **{"data.num_kv_pairs": 4})])
  with pytest.raises(ValueError, match="pairs must differ"):
    batched.check_group([_tiny_config(1e-2, 0), _tiny_config(1e-2, 0)])


def _mqar_config(arg):
  spec = importlib.util.spec_from_file_location("mqar_config", REPO / "configs" / "mqar.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg)
  config.async_checkpointing = False
  return config


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["palimpsa_d"])
def test_real_mixer_group_equals_each_run_alone(tmp_path, monkeypatch, mixer):
  monkeypatch.undo()  # the project's model, not the tiny one
  common = (f"model={mixer},seq_len=16,num_kv_pairs=2,vocab_size=32,d_model=32,num_heads=2,"
            "num_train_examples=64,num_test_examples=32,batch_size=16,num_epochs=2,"
            "evals_per_epoch=2")
  configs = [_mqar_config(f"{common},learning_rate={lr},seed={seed}") for lr, seed in RUNS[:2]]
  singles, group = _train_both(tmp_path, configs)
  for single, batch in zip(singles, group):
    _assert_same_run(single, batch)

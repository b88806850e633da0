"""Resuming a run: unreadable checkpoints, one metrics row per step, the summary across segments."""

import gc
import json
import pathlib
import shutil
import sys

import jax
import pytest

from tests.training import tiny_lm
from palimpsa_jax.data import tasks as tasks_lib
from palimpsa_jax.run_config import base
from palimpsa_jax.training import bookkeeping
from palimpsa_jax.training import checkpoint as checkpoint_lib
from palimpsa_jax.training import metrics as metrics_lib
from palimpsa_jax.training import tensorboard
from palimpsa_jax.training import trainer


@pytest.fixture(autouse=True)
def _tiny_model(monkeypatch):
  tiny_lm.use_tiny_model(monkeypatch)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """An 8-step run with checkpoints at steps 4 and 8."""
  with pytest.MonkeyPatch.context() as patcher:
    tiny_lm.use_tiny_model(patcher)
    workdir = tmp_path_factory.mktemp("finished")
    summary = trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(8), str(workdir))
  return workdir, summary


def _copy(workdir, tmp_path) -> pathlib.Path:
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy)
  return copy


def _truncate_arrays(step_dir):
  for path in (step_dir / "model").glob("ocdbt.process_0/d/*"):
    path.write_bytes(path.read_bytes()[:10])


def _remove_data_file(step_dir):
  (step_dir / "data" / "process_0-of-1.json").unlink()


def _remove_optimizer(step_dir):
  shutil.rmtree(step_dir / "optimizer")


def _losses(workdir):
  return {r["step"]: r["train/loss"] for r in metrics_lib.read_metrics(str(workdir))
          if "train/loss" in r}


@pytest.mark.parametrize("damage", [_truncate_arrays, _remove_data_file, _remove_optimizer])
def test_unreadable_latest_checkpoint_is_moved_aside(tmp_path, finished, damage):
  workdir = _copy(finished[0], tmp_path)
  damage(workdir / "checkpoints" / "8")
  with pytest.warns(RuntimeWarning, match="checkpoint step 8 .* cannot be restored") as caught:
    summary = trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(8), str(workdir))
  assert len(caught) == 1 and "resumed from step 4" in str(caught[0].message)
  (moved,) = (workdir / "corrupt_checkpoints").iterdir()
  assert moved.name.startswith("8-")
  # Steps 5-8 trained again from step 4, as in the uninterrupted run.
  assert summary["final_step"] == 8
  assert _losses(workdir) == _losses(finished[0])
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4", "8"]


def test_no_readable_checkpoint_stops_naming_the_directory(tmp_path, finished):
  workdir = _copy(finished[0], tmp_path)
  for step in ("4", "8"):
    _remove_optimizer(workdir / "checkpoints" / step)
  with pytest.raises(checkpoint_lib.CheckpointError,
                     match=f"no checkpoint in {workdir}/checkpoints restores") as refused:
    trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(8), str(workdir))
  assert not (workdir / "corrupt_checkpoints").exists()
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4", "8"]


def test_load_model_names_the_unreadable_step_and_file(tmp_path, finished):
  workdir = _copy(finished[0], tmp_path)
  _truncate_arrays(workdir / "checkpoints" / "8")
  with pytest.raises(checkpoint_lib.CheckpointError,
                     match=r"step 8 of .*checkpoints/8: .*OUT_OF_RANGE.*Other steps there: \[4\]"):
    checkpoint_lib.load_model(str(workdir))
  _, _, step = checkpoint_lib.load_model(str(workdir / "checkpoints" / "4"))
  assert step == 4


def test_a_failed_restore_leaves_no_read_running(tmp_path, monkeypatch):
  """The reads still running when one fails end inside the restore, not later in other code.

  Left running, they report "Event loop is closed" (TensorStore completing them) or an error
  when the garbage collector closes them, as unraisable exceptions in whatever runs then.
  Whether reads are still running when one fails is a race; large arrays in files cut in
  half (some read whole, some fail at once) and three restores make it one today.
  """
  reports = []
  monkeypatch.setattr(sys, "unraisablehook", reports.append)
  key = jax.random.key(0)
  params = {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (1024, 1024))
            for i in range(8)}
  checkpoint_lib.save_params(str(tmp_path), params)
  for path in (tmp_path / checkpoint_lib.PARAMS_DIR).rglob("d/*"):
    data = path.read_bytes()
    if len(data) > 1 << 20:  # array chunks; the B-tree nodes stay readable
      path.write_bytes(data[:len(data) // 2])
  abstract = jax.eval_shape(lambda: params)
  for _ in range(3):
    with pytest.raises(Exception, match="error while reading array index"):
      checkpoint_lib.restore_params(str(tmp_path), abstract)
  gc.collect()
  assert [f"{u.exc_type.__name__}: {u.exc_value}"[:200] for u in reports] == []


def test_resume_logs_each_step_once(tmp_path, finished):
  """Killed after logging step 8 but before its checkpoint: steps 6 and 8 are redone.

  Each segment also logs its start-up record (compile time) at its first step.
  """
  workdir = _copy(finished[0], tmp_path)
  shutil.rmtree(workdir / "checkpoints" / "8")
  trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(8), str(workdir))
  steps = [r["step"] for r in metrics_lib.read_metrics(str(workdir))]
  assert steps == [1, 2, 4, 5, 6, 8]
  (events,) = (workdir / "tensorboard").iterdir()
  event_steps = [tensorboard.event_step(r) for r in tensorboard.read_records(str(events))]
  assert event_steps == [0, 1, 2, 4, 5, 6, 8]  # the file header, then one event per logged step


def test_drop_metrics_after_skips_a_torn_last_line(tmp_path):
  (tmp_path / "metrics.jsonl").write_text(
      '{"step": 2, "a": 1}\n{"step": 4, "a": 2}\n{"step": 6, "a": 3}\n{"step": 8, "a"')
  metrics_lib.drop_metrics_after(str(tmp_path), 4)
  assert [r["step"] for r in metrics_lib.read_metrics(str(tmp_path))] == [2, 4]


def test_drop_events_after_keeps_one_stream_and_skips_a_torn_record(tmp_path):
  writer = tensorboard.EventFileWriter(str(tmp_path))
  for step in (2, 4, 6):
    writer.scalars(step, {"train/loss": float(step)})
  writer.close()
  with open(writer.path, "ab") as f:
    f.write(tensorboard.frame_record(tensorboard.encode_event(0.0, 8, {"a": 1.0}))[:-3])
  tensorboard.drop_events_after(str(tmp_path), 4)
  again = tensorboard.EventFileWriter(str(tmp_path))
  again.scalars(6, {"train/loss": 6.0})
  again.close()
  assert again.path == writer.path and len(list(tmp_path.iterdir())) == 1
  assert [tensorboard.event_step(r) for r in tensorboard.read_records(writer.path)] == [
      0, 2, 4, 6]


def test_summary_is_kept_across_segments(tmp_path, finished):
  workdir = _copy(finished[0], tmp_path)
  first = finished[1]
  assert first["last_eval"] and len(first["segments"]) == 1
  # Already finished: summary.json stays as it was, byte for byte.
  before = (workdir / "summary.json").read_text()
  again = trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(8), str(workdir))
  assert (workdir / "summary.json").read_text() == before
  assert json.loads(before) == again
  for key in ("wall_time_s", "last_eval", "best_accuracy", "best_step", "final_step",
              "segments"):
    assert again[key] == first[key], key
  # Killed before its summary: that segment's time still counts.
  (workdir / "summary.json").unlink()
  extended = trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(12), str(workdir))
  assert extended["final_step"] == 12
  assert [(s["start_step"], s["final_step"]) for s in extended["segments"]] == [(0, 8), (8, 12)]
  assert extended["wall_time_s"] == pytest.approx(
      first["wall_time_s"] + extended["segments"][1]["wall_time_s"])
  assert extended["last_eval"]["eval/loss"] == metrics_lib.read_metrics(
      str(workdir))[-1]["eval/loss"]


def test_stop_request_checkpoints_the_step_and_the_rerun_continues_exactly(tmp_path, finished):
  polls = []
  def stop_before_step_six():
    polls.append(None)
    return len(polls) > 5
  workdir = tmp_path / "stopped"
  with pytest.raises(bookkeeping.Interrupted) as stopped:
    trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(8), str(workdir),
                               should_stop=stop_before_step_six)
  assert str(stopped.value) == (
      f"interrupted at step 5; checkpoint saved in {workdir}/checkpoints/5; rerun the same "
      "command to resume")
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4", "5"]
  assert not (workdir / "summary.json").exists()
  trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(8), str(workdir))
  assert _losses(workdir) == _losses(finished[0])


def test_checkpoint_after_the_time_interval_whatever_the_step_interval(tmp_path):
  config = tiny_lm.tiny_mqar_config(
      total_steps=6, checkpoint_every_steps=1000, checkpoint_every_minutes=1e-9,
      keep_checkpoints=10)
  trainer.train_and_evaluate(config, str(tmp_path))
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [
      1, 2, 3, 4, 5, 6]


def _tree_bytes(directory: pathlib.Path) -> dict[str, bytes]:
  return {str(p.relative_to(directory)): p.read_bytes()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def test_another_model_is_refused_before_anything_is_written(tmp_path, finished):
  workdir = _copy(finished[0], tmp_path)
  before = _tree_bytes(workdir)
  other = tiny_lm.resumable_mqar_config(8, **{"model.width": 32})
  with pytest.raises(base.ConfigError, match=(
      r"holds a run with other settings: config.model.width=32 \(saved: 16\)\. "
      "A resume continues the saved run")):
    trainer.train_and_evaluate(other, str(workdir))
  assert _tree_bytes(workdir) == before


def test_a_resume_that_changes_the_run_is_refused_naming_each_field(tmp_path, finished):
  workdir = _copy(finished[0], tmp_path)
  before = _tree_bytes(workdir)
  changed = tiny_lm.resumable_mqar_config(
      8, batch_size=32, **{"optimizer.learning_rate": 3e-3, "optimizer.decay_steps": 20})
  with pytest.raises(base.ConfigError) as refused:
    trainer.train_and_evaluate(changed, str(workdir))
  assert str(refused.value) == (
      f"--workdir {workdir} holds a run with other settings: config.batch_size=32 (saved: 16), "
      "config.optimizer.learning_rate=0.003 (saved: 0.01), config.optimizer.decay_steps=20 "
      "(saved: 16). A resume continues the saved run (its config.json): drop these changes to "
      "resume it as saved, or give another --workdir to start a new run.")
  assert _tree_bytes(workdir) == before


def test_more_steps_and_other_cadences_are_recorded_in_the_segment(tmp_path, finished, capsys):
  """config.json keeps the run as started; the first line after the resume shows its last eval."""
  workdir = _copy(finished[0], tmp_path)
  saved_config = (workdir / "config.json").read_bytes()
  capsys.readouterr()
  extended = tiny_lm.resumable_mqar_config(12, log_every_steps=1)
  summary = trainer.train_and_evaluate(extended, str(workdir))
  assert (workdir / "config.json").read_bytes() == saved_config
  assert summary["final_step"] == 12 and summary["total_steps"] == 12
  first, second = summary["segments"]
  assert "changed" not in first
  assert second["changed"] == {"log_every_steps": {"saved": 2, "given": 1},
                               "total_steps": {"saved": 8, "given": 12}}
  out = capsys.readouterr().out
  assert (f"resumed from {workdir}/checkpoints/8; changed since config.json: "
          "log_every_steps 2 -> 1, total_steps 8 -> 12") in out
  (line,) = [l for l in out.splitlines() if l.startswith("step  9/12")]
  accuracy = finished[1]["last_eval"]["eval/accuracy"]
  assert line.endswith(f"acc {100 * accuracy:.2f}%")


def test_an_extension_keeps_the_schedule_of_the_planned_steps(tmp_path):
  """Without decay_steps the horizon is the planned steps; a resume to more steps keeps it."""
  planned = lambda steps: tiny_lm.tiny_mqar_config(
      total_steps=steps, log_every_steps=1, eval_every_steps=4, checkpoint_every_steps=2)
  trainer.train_and_evaluate(planned(4), str(tmp_path / "whole"))
  polls = []
  with pytest.raises(bookkeeping.Interrupted):
    trainer.train_and_evaluate(planned(4), str(tmp_path / "extended"),
                               should_stop=lambda: polls.append(None) or len(polls) > 2)
  trainer.train_and_evaluate(planned(6), str(tmp_path / "extended"))
  whole, extended = (
      {r["step"]: (r["train/loss"], r["train/lr"])
       for r in metrics_lib.read_metrics(str(tmp_path / name)) if "train/loss" in r}
      for name in ("whole", "extended"))
  assert {step: extended[step] for step in whole} == whole
  assert extended[5][1] == extended[6][1] == 0.0  # the schedule's final rate


class _Killed(Exception):
  """Stands for a kill -9: the run ends where it is, with nothing saved."""


def test_a_run_killed_before_its_first_checkpoint_is_resumed_only_as_itself(
    tmp_path, finished, capsys):
  workdir = tmp_path / "run"
  polls = []
  def killed_after_step_three():
    polls.append(None)
    if len(polls) > 3:
      raise _Killed
    return False
  with pytest.raises(_Killed):
    trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(8), str(workdir),
                               should_stop=killed_after_step_three)
  assert not list((workdir / "checkpoints").iterdir())
  assert [r["step"] for r in metrics_lib.read_metrics(str(workdir))] == [1, 2]
  (workdir / "lock").write_text('{"pid": 1, "host": "h", "started": "t"}')  # as kill -9 leaves it
  before = _tree_bytes(workdir)
  other = tiny_lm.resumable_mqar_config(150, seed=1)
  with pytest.raises(base.ConfigError) as refused:
    trainer.train_and_evaluate(other, str(workdir))
  assert str(refused.value) == (
      f"--workdir {workdir} holds a run with other settings: config.seed=1 (saved: 0). A "
      "resume continues the saved run (its config.json): drop these changes to resume it as "
      "saved, or give another --workdir to start a new run.")
  assert _tree_bytes(workdir) == before  # nothing deleted, nothing replaced
  capsys.readouterr()
  trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(8), str(workdir))
  assert (f"no checkpoint in {workdir}/checkpoints yet: the run of {workdir}/config.json "
          "starts again at step 0") in capsys.readouterr().out
  assert _losses(workdir) == _losses(finished[0])

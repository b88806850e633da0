"""workdir/summary.json: a run's outcome, kept across the segments it was trained in.

A segment is one train.py invocation on the workdir (the first, then each
resume). Process 0 appends the progress of the running segment to
workdir/segments.jsonl at every checkpoint and at the end, so a segment that was
killed still counts; summary.json, written when a segment ends, holds:
  best_accuracy, best_step   best eval accuracy over all segments
  last_eval                  the latest evaluation (an earlier segment's when
                             this one evaluated nothing)
  final_step, total_steps, stopped_early, num_params
  wall_time_s                summed over the segments
  segments                   [{started (UTC), start_step, final_step, wall_time_s,
                              and for a resume that changed settings config.json does not
                              hold (more steps, cadences: run_config/resume.py)
                              changed: {field: {saved, given}}}]
A run that starts at step 0 starts a new history.
"""

import datetime
import json
import os
from typing import Any

import jax

from palimpsa_jax.training import metrics as metrics_lib
from palimpsa_jax.training import storage

SUMMARY_FILE = "summary.json"
SEGMENTS_FILE = "segments.jsonl"


def previous_evals(workdir: str, up_to_step: int
                   ) -> tuple[float | None, int | None, dict[str, float]]:
  """(best eval accuracy, its step, the last evaluation) logged up to `up_to_step`."""
  if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    return None, None, {}
  best, best_step, last_eval = None, None, {}
  for record in metrics_lib.read_metrics(workdir):
    if record["step"] > up_to_step or "eval/loss" not in record:
      continue
    last_eval = {k: v for k, v in record.items() if k.startswith(("eval/", "diag/"))}
    accuracy = record.get("eval/accuracy")
    if accuracy is not None and (best is None or accuracy > best):
      best, best_step = accuracy, record["step"]
  return best, best_step, last_eval


class RunSummary:
  """The running segment's record in segments.jsonl, and summary.json at its end."""

  def __init__(self, workdir: str, start_step: int,
               changes: dict[str, tuple[Any, Any]] | None = None):
    """`changes`: {field path: (config.json's value, this segment's)}."""
    self._workdir = workdir
    self._start_step = start_step
    self._changed = {path: {"saved": saved, "given": given}
                     for path, (saved, given) in (changes or {}).items()}
    self._started = datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="microseconds")
    self._writer = jax.process_index() == 0
    path = os.path.join(workdir, SEGMENTS_FILE)
    if self._writer and start_step == 0 and os.path.exists(path):
      with storage.writing(path):
        os.remove(path)

  def progress(self, step: int, wall_time_s: float) -> None:
    """Records that this segment reached `step` after `wall_time_s` seconds."""
    if self._writer and step > self._start_step:
      record = {"started": self._started, "start_step": self._start_step,
                "final_step": step, "wall_time_s": wall_time_s}
      if self._changed:
        record["changed"] = self._changed
      path = os.path.join(self._workdir, SEGMENTS_FILE)
      with storage.writing(path), open(path, "a") as f:
        f.write(json.dumps(record) + "\n")

  def write(self, fields: dict[str, Any], final_step: int,
            wall_time_s: float) -> dict[str, Any]:
    """The summary: `fields` with the segments' totals; written to summary.json.

    A field that is None (this segment could not measure it, e.g. the
    compile time of a re-run that trained no step) keeps its earlier value.
    """
    self.progress(final_step, wall_time_s)
    segments = _segments(self._workdir)
    path = os.path.join(self._workdir, SUMMARY_FILE)
    if os.path.exists(path):
      try:
        with open(path) as f:
          earlier = json.load(f)
      except (OSError, json.JSONDecodeError):  # an unreadable earlier summary
        earlier = {}
      fields = {key: earlier.get(key) if value is None else value
                for key, value in fields.items()}
    summary = {**fields, "final_step": final_step,
               "wall_time_s": sum(s["wall_time_s"] for s in segments),
               "segments": segments}
    if self._writer:
      # Sorted: the order of a value's keys must not depend on where it came from (a rerun
      # reads last_eval back from metrics.jsonl), or a rerun would rewrite the file.
      storage.write_whole(path, json.dumps(summary, indent=2, sort_keys=True))
    return summary


def _segments(workdir: str) -> list[dict[str, Any]]:
  """The last record of each segment in segments.jsonl, in order."""
  path = os.path.join(workdir, SEGMENTS_FILE)
  latest: dict[str, dict[str, Any]] = {}
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        try:
          record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
          continue
        latest[record["started"]] = record
  return list(latest.values())

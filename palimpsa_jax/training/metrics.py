"""Metrics: DIR/metrics.jsonl and TensorBoard events (process 0 only), terminal progress."""

import json
import math
import os
import sys
import time
from typing import Any, TextIO

import jax

from palimpsa_jax.training import compile_cache
from palimpsa_jax.training import storage
from palimpsa_jax.training import tensorboard

# Peak dense bf16 FLOP/s per device, for MFU; devices not listed get no MFU.
_PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
}


def peak_flops_per_device() -> float | None:
  """Peak bf16 FLOP/s of this platform's devices, or None if unknown."""
  return _PEAK_FLOPS.get(jax.devices()[0].device_kind)


def _jsonable(value: Any) -> Any:
  if hasattr(value, "item"):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


class MetricWriter:
  """One JSON object per logged step in DIR/metrics.jsonl, and the same scalars
  as TensorBoard events in DIR/tensorboard/ (process 0 only).

  A run that starts at `start_step` (resumed from that checkpoint, or 0) first
  drops what an earlier run logged after it, in both, so each step appears once.
  """

  def __init__(self, workdir: str, start_step: int = 0):
    self._file: TextIO | None = None
    self._events: tensorboard.EventFileWriter | None = None
    self._path = os.path.join(workdir, "metrics.jsonl")
    self._logdir = os.path.join(workdir, "tensorboard")
    if jax.process_index() == 0:
      with storage.writing(self._path):
        os.makedirs(workdir, exist_ok=True)
        drop_metrics_after(workdir, start_step)
        self._file = open(self._path, "a")
      with storage.writing(self._logdir):
        if os.path.isdir(self._logdir):
          tensorboard.drop_events_after(self._logdir, start_step)
        self._events = tensorboard.EventFileWriter(self._logdir)

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    """Appends one record to both; raises storage.WriteFailed naming the file that failed."""
    if self._file is None:
      return
    record = {"step": int(step)}
    record.update({k: _jsonable(v) for k, v in sorted(metrics.items())})
    with storage.writing(self._path):
      self._file.write(json.dumps(record) + "\n")
      self._file.flush()
    with storage.writing(self._events.path):
      self._events.scalars(int(step), {k: float(v) for k, v in sorted(metrics.items())})

  def close(self) -> None:
    """Closes both files; raises storage.WriteFailed if what was buffered cannot be written
    (both are closed either way)."""
    files, self._file, self._events = (self._file, self._events), None, None
    failure = None
    for path, file in zip((self._path, self._logdir), files):
      try:
        with storage.writing(path):
          if file is not None:
            file.close()
      except storage.WriteFailed as error:
        failure = failure or error
    if failure is not None:
      raise failure


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The records of DIR/metrics.jsonl, in order."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def drop_metrics_after(workdir: str, step: int) -> None:
  """Rewrites DIR/metrics.jsonl without its records past `step` (and a torn last line)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = f.read().splitlines(keepends=True)
  kept = []
  for line in lines:
    try:
      record = json.loads(line)
    except json.JSONDecodeError:  # a line cut short by a crash
      continue
    if record["step"] <= step:
      kept.append(line if line.endswith("\n") else line + "\n")
  if kept == lines:
    return
  partial = path + ".partial"
  with open(partial, "w") as f:
    f.writelines(kept)
  os.replace(partial, path)


def _duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  minutes, seconds = divmod(rest, 60)
  return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def throughput_metrics(steps_per_sec: float, tokens_per_step: int, num_params: int,
                       peak_flops: float | None, num_devices: int) -> dict[str, float]:
  """perf/steps_per_sec, perf/tokens_per_sec and (with a known peak) perf/mfu at 6 FLOPs
  per parameter and token over `num_devices` devices."""
  tokens_per_sec = steps_per_sec * tokens_per_step
  record = {"perf/steps_per_sec": steps_per_sec, "perf/tokens_per_sec": tokens_per_sec}
  if peak_flops is not None:
    record["perf/mfu"] = 6 * num_params * tokens_per_sec / (peak_flops * num_devices)
  return record


def startup_metrics(timing: compile_cache.CompileTiming,
                    time_to_first_step_s: float) -> dict[str, float]:
  """The once-per-start record: perf/lower_s, perf/compile_s, perf/compile_cache_hits
  (from the train step's timing) and perf/time_to_first_step_s (command start to the end of
  the first step)."""
  return {"perf/lower_s": timing.lower_s, "perf/compile_s": timing.compile_s,
          "perf/compile_cache_hits": timing.cache_hits,
          "perf/time_to_first_step_s": time_to_first_step_s}


def summary_details(summary: dict[str, Any]) -> str:
  """"; 120,000 tokens/s; first step after 31.0 s (compile 4.2 s); eval loss 3.2100" for
  the final line (parts whose values are missing are left out)."""
  parts = []
  if summary.get("tokens_per_sec"):
    parts.append(f"{summary['tokens_per_sec']:,.0f} tokens/s")
  if summary.get("time_to_first_step_s") is not None:
    parts.append(f"first step after {summary['time_to_first_step_s']:.1f} s "
                 f"(compile {summary['compile_s']:.1f} s)")
  loss = (summary.get("last_eval") or {}).get("eval/loss")
  if loss is not None:
    parts.append(f"eval loss {loss:.4f}")
  return "".join("; " + p for p in parts)


class Progress:
  """One line per logged step: step/total, steps/s, tokens/s, MFU, ETA, loss, last eval.

  "elapsed" counts from `started_at` (time.time() when the command started), the same point
  from which the start-up line's "first step after" counts; the last evaluation starts as
  `last_eval` (a resumed run's latest, from its metrics).
  """

  def __init__(self, total_steps: int, start_step: int, started_at: float,
               last_eval: dict[str, float] | None = None):
    self._total = total_steps
    self._mark_step = start_step
    self._mark_time = time.perf_counter()
    self._started_at = started_at
    self.last_accuracy: float | None = (last_eval or {}).get("eval/accuracy")
    self.last_eval_loss: float | None = (last_eval or {}).get("eval/loss")

  def rate(self, step: int) -> float | None:
    """Steps per second since the previous mark (None if no step since); resets the mark."""
    now = time.perf_counter()
    if step == self._mark_step:
      return None
    rate = (step - self._mark_step) / max(now - self._mark_time, 1e-9)
    self._mark_step, self._mark_time = step, now
    return rate

  def restart_clock(self, step: int) -> None:
    """Excludes time spent since the last mark (evaluation) from the next rate."""
    self._mark_step, self._mark_time = step, time.perf_counter()

  def elapsed(self) -> float:
    """Seconds since the command started."""
    return time.time() - self._started_at

  def show_startup(self, startup: dict[str, float]) -> None:
    """The line after the first step: time to it and the train step's compile."""
    if jax.process_index() != 0:
      return
    hits = int(startup["perf/compile_cache_hits"])
    cache = f"{hits} from the compilation cache" if hits else "not from the compilation cache"
    print(f"first step after {startup['perf/time_to_first_step_s']:.1f} s; train step "
          f"traced in {startup['perf/lower_s']:.1f} s, compiled in "
          f"{startup['perf/compile_s']:.1f} s ({cache})", file=sys.stdout, flush=True)

  def show(self, step: int, steps_per_sec: float | None, loss: float,
           tokens_per_sec: float | None = None, mfu: float | None = None) -> None:
    """Prints the line; steps_per_sec None (the first step) shows "-" and no ETA."""
    if jax.process_index() != 0:
      return
    width = len(str(self._total))
    accuracy = ("-" if self.last_accuracy is None
                else f"{100 * self.last_accuracy:.2f}%")
    if steps_per_sec:
      eta = _duration((self._total - step) / steps_per_sec)
      rates = f"{steps_per_sec:6.2f} steps/s"
    else:
      eta, rates = "-", f"{'-':>6} steps/s"
    if tokens_per_sec is not None:
      rates += f" {tokens_per_sec:9,.0f} tokens/s"
    if mfu is not None:
      rates += f" MFU {100 * mfu:4.1f}%"
    eval_loss = "" if self.last_eval_loss is None else f" loss {self.last_eval_loss:.4f}"
    print(f"step {step:>{width}}/{self._total} | {rates} | "
          f"elapsed {_duration(self.elapsed())} ETA {eta} | "
          f"loss {loss:.4f} | last eval{eval_loss} acc {accuracy}",
          file=sys.stdout, flush=True)

"""The cadence of the training loop (training/loop.py): when it logs, evaluates, checkpoints.

  cadence = Cadence(config, total_steps, start_step, started_at, should_stop, interrupt,
                    last_eval)
  while ...:
    overdue = cadence.before_step(step, time_due)   # a stop request: interrupt(step), Interrupted
    ... one train step ...
    due = cadence.after_step(step, overdue)          # log / evaluate / save due
    if due.log: rate = cadence.progress.rate(step)
    if due.evaluate: ...; cadence.evaluated(step, results)
    if due.log: cadence.progress.show(step, rate, loss, ...)

Logging and evaluation are due every config.log_every_steps / eval_every_steps steps and at the
last step; a checkpoint every config.checkpoint_every_steps, at the last step, and when the
run's config.checkpoint_every_minutes have passed (`time_due`). With several processes the stop
request and the clock are agreed on at logged steps (bookkeeping.agreed).
"""

from collections.abc import Callable
import dataclasses
from typing import Any

import ml_collections

from palimpsa_jax.training import bookkeeping
from palimpsa_jax.training import metrics as metrics_lib


@dataclasses.dataclass(frozen=True)
class Due:
  """What is due after a step."""
  last: bool  # the run's last step
  log: bool
  evaluate: bool
  save: bool  # the step interval, the last step or the clock (an early stop saves too)


class Cadence:
  """When a loop logs, evaluates, checkpoints and stops, and its progress line."""

  def __init__(self, config: ml_collections.ConfigDict, total_steps: int, start_step: int,
               started_at: float, should_stop: Callable[[], bool],
               interrupt: Callable[[int], str], last_eval: dict[str, float] | None = None):
    """
    Args:
      config: the run config (its log, eval and checkpoint cadences).
      total_steps: the run's steps.
      start_step: the step it starts (or resumes) at.
      started_at: time.time() when the command started (the progress line's clock).
      should_stop: polled before every step (e.g. bookkeeping.StopSignals).
      interrupt: step -> where: checkpoints the step reached for a stop request, waits for
        the write, and says where it went (for Interrupted's message).
      last_eval: the run's latest evaluation before `start_step`, for the progress line.
    """
    self._config = config
    self._total_steps = total_steps
    self._should_stop = should_stop
    self._interrupt = interrupt
    self.progress = metrics_lib.Progress(total_steps, start_step, started_at, last_eval)

  def before_step(self, step: int, time_due: bool) -> bool:
    """Whether a checkpoint is overdue by the clock, as every process agreed on it.

    Raises:
      bookkeeping.Interrupted: a stop request, once `interrupt` has saved `step`.
    """
    stop, overdue = bookkeeping.agreed(step, self._config.log_every_steps,
                                       self._should_stop(), time_due)
    if stop:
      raise bookkeeping.Interrupted(step, self._interrupt(step))
    return overdue

  def after_step(self, step: int, overdue: bool) -> Due:
    """What is due after `step` (`overdue`: before_step's answer)."""
    config = self._config
    last = step == self._total_steps
    return Due(last=last, log=step % config.log_every_steps == 0 or last,
               evaluate=step % config.eval_every_steps == 0 or last,
               save=step % config.checkpoint_every_steps == 0 or last or overdue)

  def evaluated(self, step: int, results: dict[str, Any]) -> None:
    """Notes an evaluation at `step`: the progress line shows it, the rates leave out its time."""
    self.progress.restart_clock(step)
    self.progress.last_eval_loss = results.get("eval/loss")
    if results.get("eval/accuracy") is not None:
      self.progress.last_accuracy = results["eval/accuracy"]

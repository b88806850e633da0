"""Long-context suite: mean NLL per position bucket, for one or several checkpoints, with a plot.

Held-out documents are packed into rows of max_length as in training. A token's position is its
distance from the start of its segment (where the recurrent state last restarted), so the
buckets [1, 2), [2, 4), [4, 8), ..., [max_length / 2, max_length) show how prediction changes as
the context grows; the paper uses this to show that metaplastic models degrade more slowly.

  python eval.py --suite long_context --checkpoint A,B --files 'heldout/*.jsonl' --max_length 4096
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
import os
from typing import Any

import numpy as np

from palimpsa_jax.data import text as text_lib
from palimpsa_jax.evaluation import lm as lm_lib
from palimpsa_jax.training import checkpoint as checkpoint_lib
from palimpsa_jax.training import storage

DEFAULT_BATCH_SIZE = 1


def bucket_edges(max_length: int) -> np.ndarray:
  """Upper edges of the position buckets: powers of two below max_length, then max_length."""
  if max_length < 2:
    raise lm_lib.OptionError(f"max_length must be >= 2, got {max_length}")
  edges = [2]
  while edges[-1] < max_length:
    edges.append(min(2 * edges[-1], max_length))
  return np.asarray(edges, np.int64)


def positions_in_segment(segment_ids: np.ndarray) -> np.ndarray:
  """Index of each token within its segment: [B, T] int64 (0 at each segment start)."""
  batch, length = segment_ids.shape
  starts = np.ones((batch, length), bool)
  starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
  index = np.broadcast_to(np.arange(length), (batch, length))
  last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
  return index - last_start


def bucket_nll_sums(log_probs: np.ndarray, weights: np.ndarray, segment_ids: np.ndarray,
                    edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Sums of NLL and counts per bucket for one batch.

  Args:
    log_probs: [B, T] log p(token t + 1 | tokens <= t).
    weights: [B, T] 1 where the prediction is scored (next_token_targets).
    segment_ids: [B, T].
    edges: bucket upper edges [n].

  Returns:
    nll sums [n] f64 and counts [n] f64; the predicted token t + 1 sits at position
    positions_in_segment[t] + 1 and falls in the first bucket whose edge exceeds it.
  """
  predicted_position = positions_in_segment(segment_ids) + 1
  bucket = np.searchsorted(edges, predicted_position, side="right")
  valid = (weights > 0) & (bucket < len(edges))
  nll = np.bincount(bucket[valid], weights=-log_probs[valid].astype(np.float64),
                    minlength=len(edges))
  counts = np.bincount(bucket[valid], minlength=len(edges)).astype(np.float64)
  return nll, counts


def nll_by_position(scorer: lm_lib.ModelScorer, batches: Iterable[Mapping[str, np.ndarray]],
                    max_length: int) -> dict[str, list]:
  """Mean NLL per position bucket over packed batches of rows of max_length.

  Returns:
    {"bucket_end": [n] upper edges, "mean_nll": [n] (None for an empty bucket), "count": [n]}.
  """
  edges = bucket_edges(max_length)
  nll = np.zeros(len(edges))
  counts = np.zeros(len(edges))
  for batch in batches:
    targets, weights = text_lib.next_token_targets(batch["tokens"], batch["segment_ids"],
                                                   batch.get("mask"))
    log_probs, _ = scorer(batch["tokens"], batch["segment_ids"], targets)
    batch_nll, batch_counts = bucket_nll_sums(log_probs, weights, batch["segment_ids"], edges)
    nll += batch_nll
    counts += batch_counts
  mean = [float(s / c) if c else None for s, c in zip(nll, counts)]
  return {"bucket_end": edges.tolist(), "mean_nll": mean, "count": counts.astype(int).tolist()}


def plot_curves(curves: Mapping[str, Mapping[str, list]], path: str) -> None:
  """PNG of mean NLL against position bucket, one line per checkpoint.

  Args:
    curves: checkpoint path -> {"bucket_end", "mean_nll", "step"}.
    path: the PNG to write.
  """
  # Deferred: matplotlib is slow to import and only the plot needs it.
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  for checkpoint, curve in curves.items():
    name = os.path.basename(checkpoint_lib.workdir_of(checkpoint))
    label = f"{name} (step {curve['step']})"
    points = [(e, m) for e, m in zip(curve["bucket_end"], curve["mean_nll"]) if m is not None]
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("position in document (bucket upper edge)")
  ax.set_ylabel("mean NLL (nats)")
  ax.set_title("NLL by position")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize="small")
  fig.tight_layout()
  try:
    with storage.writing(path):  # a full or read-only disk: one line naming the plot
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
      fig.savefig(path, dpi=120)
  finally:
    plt.close(fig)


def _plot_path(options: Mapping[str, Any], checkpoints: Sequence[str]) -> str:
  """Next to --output, else in the first checkpoint's workdir (beside eval.py's JSON)."""
  if options.get("output"):
    return os.path.splitext(options["output"])[0] + ".png"
  return os.path.join(checkpoint_lib.workdir_of(checkpoints[0]), "eval_long_context.png")


def run(options: Mapping[str, Any]) -> dict[str, Any]:
  """eval.py --suite long_context.

  Options: "checkpoint" (list), "files" (glob of held-out files), "max_length" (row length and
  largest position, default: the first run's seq_len), "batch_size", "output" (the plot goes
  next to it, as .png), "mesh_sequence" (devices each row is split over, lm_lib.ModelScorer).

  Returns:
    {"max_length", "bucket_end": [n], "checkpoints": {path: {"mean_nll": [n], "count": [n],
    "step"}}, "plot": path of the PNG}.
  """
  files = lm_lib.heldout_files(options, "long_context")
  checkpoints = lm_lib.checkpoints_option(options)
  max_length = lm_lib.int_option(options, "max_length", None)
  batch_size = lm_lib.int_option(options, "batch_size", DEFAULT_BATCH_SIZE)
  sequence_devices = lm_lib.int_option(options, "mesh_sequence", 1)
  curves = {}
  for checkpoint in checkpoints:
    model, config, step, tokenizer = lm_lib.load_checkpoint(checkpoint)
    max_length = max_length or int(config.seq_len)
    batches = text_lib.make_text_eval_dataset(files, tokenizer, max_length, batch_size)
    curve = nll_by_position(lm_lib.ModelScorer(model, sequence_devices), batches, max_length)
    curves[checkpoint] = {**curve, "step": int(step)}
    print(f"{checkpoint}: " + "  ".join(
        f"<{e}: {m:.3f}" for e, m in zip(curve["bucket_end"], curve["mean_nll"]) if m is not None),
          flush=True)
  plot = _plot_path(options, checkpoints)
  plot_curves(curves, plot)
  edges = next(iter(curves.values()))["bucket_end"]
  for curve in curves.values():
    del curve["bucket_end"]
  return {"max_length": max_length, "bucket_end": edges, "checkpoints": curves, "plot": plot,
          "files": files}

"""grain pipelines over in-memory arrays, sharded per host, with checkpointable state.

A pipeline yields dicts of numpy arrays with a leading per-host batch axis. Its
iterator is a `grain.DatasetIterator`: `get_state()` / `set_state()` (and the
Orbax `grain.checkpoint.CheckpointHandler`) save and restore the position, so
a resumed run sees exactly the batches an uninterrupted run would.
"""

from collections.abc import Mapping

import grain
import jax
import numpy as np

# Batches are gathered with one vectorised index per batch: reading is cheap, so
# a single reader thread and a short prefetch buffer suffice (and keep CPU
# cores for the training step).
_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)


def host_shard() -> tuple[int, int]:
  """(index, count) of this host's data shard: jax.process_index()/count()."""
  return jax.process_index(), jax.process_count()


def per_host_batch_size(global_batch_size: int, shard_count: int) -> int:
  """The part of a global batch one host loads; raises if it does not divide."""
  if global_batch_size <= 0 or global_batch_size % shard_count:
    raise ValueError(
        f"batch_size={global_batch_size} must be a positive multiple of the "
        f"number of hosts ({shard_count}).")
  return global_batch_size // shard_count


def _check_arrays(arrays: Mapping[str, np.ndarray]) -> int:
  if not arrays:
    raise ValueError("arrays must hold at least one array.")
  lengths = {name: len(a) for name, a in arrays.items()}
  if len(set(lengths.values())) != 1:
    raise ValueError(f"arrays must share their leading length, got {lengths}.")
  return next(iter(lengths.values()))


def array_dataset(arrays: Mapping[str, np.ndarray],
                  *,
                  batch_size: int,
                  seed: int,
                  shuffle: bool = True,
                  num_epochs: int | None = None,
                  shard_index: int = 0,
                  shard_count: int = 1) -> grain.IterDataset:
  """Batches of rows of `arrays`, this host's shard only.

  Args:
    arrays: name -> [N, ...] arrays sharing N.
    batch_size: rows per batch on this host (the per-host batch).
    seed: shuffle seed; each epoch is shuffled differently but reproducibly.
    shuffle: shuffle rows (training) or keep their order (evaluation).
    num_epochs: passes over the data; None repeats forever.
    shard_index: this host's shard (rows shard_index, shard_index + count, ...).
    shard_count: number of hosts.

  Returns:
    grain.IterDataset of {name: [batch_size, ...]}; incomplete final batches
    are dropped, so every batch has the same shape.
  """
  num_rows = _check_arrays(arrays)
  if not 0 <= shard_index < shard_count:
    raise ValueError(
        f"shard_index={shard_index} must lie in [0, shard_count={shard_count}).")
  rows = grain.MapDataset.range(num_rows)[shard_index::shard_count]
  if len(rows) < batch_size:
    raise ValueError(
        f"this host's shard has {len(rows)} rows, fewer than batch_size="
        f"{batch_size}.")
  if shuffle:
    rows = rows.shuffle(seed=seed)
  if num_epochs != 1:
    rows = rows.repeat(num_epochs)
  batches = rows.batch(batch_size, drop_remainder=True)
  gathered = batches.map(
      lambda index: {name: a[index] for name, a in arrays.items()})
  return gathered.to_iter_dataset(_READ_OPTIONS)


def pad_rows(arrays: Mapping[str, np.ndarray], multiple: int,
             fill: Mapping[str, int]) -> dict[str, np.ndarray]:
  """Pads every array along axis 0 to a multiple of `multiple` rows.

  Args:
    arrays: name -> [N, ...].
    multiple: the padded length is the smallest multiple of this >= N.
    fill: name -> value of the padded rows (e.g. IGNORE_INDEX for targets so
      padded rows never count).

  Returns:
    name -> [ceil(N / multiple) * multiple, ...].
  """
  num_rows = _check_arrays(arrays)
  padded = -(-num_rows // multiple) * multiple
  out = {}
  for name, a in arrays.items():
    extra = np.full((padded - num_rows,) + a.shape[1:], fill[name], a.dtype)
    out[name] = np.concatenate([a, extra]) if len(extra) else a
  return out

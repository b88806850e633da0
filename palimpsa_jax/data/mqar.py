"""Multi-query associative recall (MQAR), with the Zoology generator's semantics.

One example of length L with n key-value pairs over a vocabulary of W tokens:
  * keys are drawn without replacement from [1, W // 2), values without
    replacement from [W // 2, W);
  * the first 2n tokens are k1 v1 k2 v2 ... kn vn;
  * the remaining L - 2n positions form (L - 2n) / 2 query slots (even offsets
    after the context); n slots are drawn without replacement with probability
    proportional to i ** (power_a - 1) (i = 1 .. slots) and every key is placed
    in exactly one of them;
  * all other positions hold 0 (or uniform random tokens in [0, W) when
    `random_non_queries`);
  * the target at a query position is the value paired with that key; every
    other target is IGNORE_INDEX (-100).
"""

import numpy as np

from palimpsa_jax import user_errors

IGNORE_INDEX = -100

# Rows processed at once when sampling keys/values: bounds the [rows, W / 2]
# scratch table to a few tens of MB whatever the number of examples.
_ROWS_PER_CHUNK = 8192


class SettingError(ValueError, user_errors.UserError):
  """MQAR settings no example can satisfy."""


def check_setting(seq_len: int, num_kv_pairs: int, vocab_size: int | None = None) -> None:
  """Raises SettingError unless examples of length seq_len with num_kv_pairs pairs exist
  (over vocab_size tokens, when given); the message says what is needed."""
  for name, value in (("seq_len", seq_len), ("num_kv_pairs", num_kv_pairs),
                      ("vocab_size", vocab_size)):
    if value is None:
      continue
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
      raise SettingError(f"{name} must be an int, got {type(value).__name__}.")
    if value <= 0:
      raise SettingError(f"{name} must be positive, got {value}.")
  if seq_len % 2:
    raise SettingError(
        f"seq_len must be even (key/query slots are pairs), got {seq_len}.")
  if 4 * num_kv_pairs > seq_len:
    raise SettingError(
        f"num_kv_pairs={num_kv_pairs} needs seq_len >= 4 * num_kv_pairs = {4 * num_kv_pairs} "
        f"(2n context tokens plus n query slots of 2), got seq_len={seq_len}: use "
        f"num_kv_pairs <= {seq_len // 4} or seq_len >= {4 * num_kv_pairs}.")
  if vocab_size is None:
    return
  num_keys = vocab_size // 2 - 1
  num_values = vocab_size - vocab_size // 2
  if num_kv_pairs > min(num_keys, num_values):
    raise SettingError(
        f"vocab_size={vocab_size} is too small for num_kv_pairs={num_kv_pairs}: "
        f"keys come from [1, {vocab_size // 2}) ({num_keys} tokens) and must be "
        f"distinct; need vocab_size >= {2 * num_kv_pairs + 2}.")


def _validate(vocab_size: int, num_examples: int, input_seq_len: int,
              num_kv_pairs: int, power_a: float) -> None:
  """Raises SettingError for settings no MQAR example can satisfy."""
  check_setting(input_seq_len, num_kv_pairs, vocab_size)
  if not isinstance(num_examples, (int, np.integer)) or isinstance(num_examples, bool):
    raise SettingError(f"num_examples must be an int, got {type(num_examples).__name__}.")
  if num_examples <= 0:
    raise SettingError(f"num_examples must be positive, got {num_examples}.")
  if not power_a > 0:
    raise SettingError(f"power_a must be > 0, got {power_a}.")


def _sample_without_replacement(rng: np.random.Generator, num_rows: int,
                                low: int, high: int, size: int) -> np.ndarray:
  """Per row, `size` distinct uniform integers from [low, high) in random order.

  A partial Fisher-Yates shuffle run on all rows at once.

  Returns:
    [num_rows, size] int32.
  """
  population = high - low
  out = np.empty((num_rows, size), np.int32)
  for start in range(0, num_rows, _ROWS_PER_CHUNK):
    rows = min(_ROWS_PER_CHUNK, num_rows - start)
    table = np.tile(np.arange(low, high, dtype=np.int32), (rows, 1))
    row_index = np.arange(rows)
    for i in range(size):
      j = rng.integers(i, population, size=rows)
      picked = table[row_index, j]
      table[row_index, j] = table[row_index, i]
      table[row_index, i] = picked
    out[start:start + rows] = table[:, :size]
  return out


def query_slot_probabilities(num_slots: int, power_a: float) -> np.ndarray:
  """P(slot i) proportional to i ** (power_a - 1), i = 1 .. num_slots; [num_slots]."""
  weights = np.arange(1, num_slots + 1, dtype=np.float64) ** (power_a - 1)
  return weights / weights.sum()


def multiquery_ar(vocab_size: int,
                  num_examples: int,
                  input_seq_len: int,
                  num_kv_pairs: int,
                  power_a: float = 0.01,
                  random_non_queries: bool = False,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Generates MQAR examples.

  Args:
    vocab_size: W; keys come from [1, W // 2), values from [W // 2, W).
    num_examples: number of examples N.
    input_seq_len: L, even, >= 4 * num_kv_pairs.
    num_kv_pairs: n key-value pairs per example (each key queried once).
    power_a: exponent of the power law placing queries (small: early slots).
    random_non_queries: fill non-key/value/query positions with random tokens
      from [0, W) instead of 0.
    seed: numpy seed; the same arguments always give the same arrays.

  Returns:
    (inputs, targets), both [N, L] int32; targets are IGNORE_INDEX except at
    the n query positions of each row, where they hold the paired value.
  """
  _validate(vocab_size, num_examples, input_seq_len, num_kv_pairs, power_a)
  rng = np.random.default_rng(seed)
  n = num_kv_pairs
  context = 2 * n
  half = vocab_size // 2
  keys = _sample_without_replacement(rng, num_examples, 1, half, n)
  values = _sample_without_replacement(rng, num_examples, half, vocab_size, n)

  # Weighted sampling of n slots without replacement (successive draws
  # proportional to p) via exponential race keys: the n smallest E_i / p_i.
  num_slots = (input_seq_len - context) // 2
  log_p = np.log(query_slot_probabilities(num_slots, power_a))
  race = np.log(rng.exponential(size=(num_examples, num_slots))) - log_p
  slots = np.argpartition(race, n - 1, axis=1)[:, :n] if n < num_slots else (
      np.argsort(race, axis=1))
  query_positions = context + 2 * slots

  inputs = np.zeros((num_examples, input_seq_len), np.int32)
  inputs[:, 0:context:2] = keys
  inputs[:, 1:context:2] = values
  np.put_along_axis(inputs, query_positions, keys, axis=1)
  targets = np.full((num_examples, input_seq_len), IGNORE_INDEX, np.int32)
  np.put_along_axis(targets, query_positions, values, axis=1)
  if random_non_queries:
    noise = rng.integers(0, vocab_size, size=inputs.shape, dtype=np.int32)
    inputs = np.where(inputs == 0, noise, inputs)
  return inputs, targets


def target_positions(targets: np.ndarray) -> np.ndarray:
  """Ascending positions of each row's counted targets (the query positions).

  Args:
    targets: [N, L] int, IGNORE_INDEX where nothing is predicted; every row
      must count the same number of targets (MQAR: num_kv_pairs).

  Returns:
    [N, n] int32.

  Raises:
    ValueError: rows count different numbers of targets.
  """
  counted = np.asarray(targets) != IGNORE_INDEX
  per_row = counted.sum(axis=1)
  if per_row.size and per_row.min() != per_row.max():
    raise ValueError(
        "targets rows count between "
        f"{per_row.min()} and {per_row.max()} targets; target_positions needs "
        "the same number in every row.")
  # np.nonzero lists the positions row by row, ascending within a row.
  columns = np.nonzero(counted)[1]
  return columns.reshape(counted.shape[0], -1).astype(np.int32)

"""MQAR generator: Zoology semantics, errors, and the grain pipeline."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest

from palimpsa_jax.data import mqar
from palimpsa_jax.data import pipeline

W, N, L, KV = 64, 400, 48, 6


@pytest.fixture(scope="module")
def data():
  return mqar.multiquery_ar(W, N, L, KV, seed=3)


def test_shapes_and_dtypes(data):
  inputs, targets = data
  assert inputs.shape == targets.shape == (N, L)
  assert inputs.dtype == targets.dtype == np.int32


def test_context_keys_and_values(data):
  inputs, _ = data
  keys, values = inputs[:, 0:2 * KV:2], inputs[:, 1:2 * KV:2]
  assert keys.min() >= 1 and keys.max() < W // 2
  assert values.min() >= W // 2 and values.max() < W
  for row_keys, row_values in zip(keys, values):
    assert len(set(row_keys)) == KV and len(set(row_values)) == KV


def test_every_key_queried_once_with_its_value(data):
  inputs, targets = data
  for row_inputs, row_targets in zip(inputs, targets):
    pairs = dict(zip(row_inputs[0:2 * KV:2], row_inputs[1:2 * KV:2]))
    positions = np.flatnonzero(row_targets != mqar.IGNORE_INDEX)
    assert len(positions) == KV
    assert np.all(positions >= 2 * KV) and np.all((positions - 2 * KV) % 2 == 0)
    assert sorted(row_inputs[positions]) == sorted(pairs)
    for p in positions:
      assert row_targets[p] == pairs[row_inputs[p]]
    rest = np.ones(L, bool)
    rest[:2 * KV] = False
    rest[positions] = False
    assert np.all(row_inputs[rest] == 0)


def test_target_positions_are_the_query_positions(data):
  _, targets = data
  positions = mqar.target_positions(targets)
  assert positions.shape == (N, KV) and positions.dtype == np.int32
  assert (np.diff(positions, axis=1) > 0).all()
  expected = np.full_like(targets, mqar.IGNORE_INDEX)
  np.put_along_axis(expected, positions,
                    np.take_along_axis(targets, positions, axis=1), axis=1)
  np.testing.assert_array_equal(expected, targets)
  uneven = targets.copy()
  uneven[0, positions[0, 0]] = mqar.IGNORE_INDEX
  with pytest.raises(ValueError, match="same number in every row"):
    mqar.target_positions(uneven)


def test_power_law_query_placement():
  # With few pairs, P(slot i chosen first) ~ i ** (a - 1): slot 1 dominates.
  a, kv, length = 0.3, 1, 2 + 2 * 10
  inputs, targets = mqar.multiquery_ar(64, 20000, length, kv, power_a=a, seed=0)
  slots = (np.argmax(targets != mqar.IGNORE_INDEX, axis=1) - 2 * kv) // 2
  observed = np.bincount(slots, minlength=10) / len(slots)
  expected = mqar.query_slot_probabilities(10, a)
  np.testing.assert_allclose(observed, expected, atol=0.015)


def test_deterministic_and_seeded():
  a = mqar.multiquery_ar(W, 50, L, KV, seed=1)
  b = mqar.multiquery_ar(W, 50, L, KV, seed=1)
  c = mqar.multiquery_ar(W, 50, L, KV, seed=2)
  np.testing.assert_array_equal(a[0], b[0])
  assert not np.array_equal(a[0], c[0])


def test_random_non_queries_fill_zeros():
  inputs, targets = mqar.multiquery_ar(W, 50, L, KV, random_non_queries=True, seed=0)
  plain, plain_targets = mqar.multiquery_ar(W, 50, L, KV, seed=0)
  np.testing.assert_array_equal(targets, plain_targets)
  kept = plain != 0
  np.testing.assert_array_equal(inputs[kept], plain[kept])
  assert (inputs[~kept] != 0).mean() > 0.9


def test_full_query_region():
  inputs, targets = mqar.multiquery_ar(W, 20, 4 * KV, KV, seed=0)
  assert np.all((targets[:, 2 * KV::2]) != mqar.IGNORE_INDEX)


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_seq_len=47), "even"),
    (dict(num_kv_pairs=13), "4 \\* num_kv_pairs"),
    (dict(vocab_size=12), "too small"),
    (dict(num_examples=0), "num_examples"),
    (dict(power_a=0.0), "power_a"),
])
def test_impossible_settings(kwargs, match):
  args = dict(vocab_size=W, num_examples=4, input_seq_len=L, num_kv_pairs=KV)
  args.update(kwargs)
  with pytest.raises(mqar.SettingError, match=match):
    mqar.multiquery_ar(**args)


def test_the_config_refuses_an_impossible_setting_where_it_is_given():
  spec = importlib.util.spec_from_file_location(
      "mqar_config", pathlib.Path(__file__).parents[2] / "configs" / "mqar.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  with pytest.raises(mqar.SettingError) as refused:
    module.get_config("num_kv_pairs=20")  # the default seq_len is 32
  assert str(refused.value) == (
      "num_kv_pairs=20 needs seq_len >= 4 * num_kv_pairs = 80 (2n context tokens plus n "
      "query slots of 2), got seq_len=32: use num_kv_pairs <= 8 or seq_len >= 80.")
  with pytest.raises(mqar.SettingError, match="need vocab_size >= 42"):
    module.get_config("num_kv_pairs=20,seq_len=80,vocab_size=40")
  module.get_config("num_kv_pairs=20,seq_len=80")


def test_pipeline_sharded_deterministic_and_resumable():
  arrays = {"x": np.arange(40, dtype=np.int32)}
  shards = [pipeline.array_dataset(arrays, batch_size=4, seed=5, num_epochs=1,
                                   shard_index=i, shard_count=2) for i in range(2)]
  seen = [np.concatenate([b["x"] for b in shard]) for shard in shards]
  assert not set(seen[0]) & set(seen[1])
  assert sorted(np.concatenate(seen)) == list(range(40))

  ds = pipeline.array_dataset(arrays, batch_size=4, seed=5)
  it = iter(ds)
  for _ in range(7):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it)["x"] for _ in range(5)]
  resumed = iter(ds)
  resumed.set_state(state)
  np.testing.assert_array_equal([next(resumed)["x"] for _ in range(5)], expected)
  first = [b["x"] for _, b in zip(range(3), iter(ds))]
  np.testing.assert_array_equal(first, [b["x"] for _, b in zip(range(3), iter(ds))])


def test_pipeline_errors_and_padding():
  with pytest.raises(ValueError, match="leading length"):
    pipeline.array_dataset({"a": np.zeros(3), "b": np.zeros(4)}, batch_size=1, seed=0)
  with pytest.raises(ValueError, match="fewer than batch_size"):
    pipeline.array_dataset({"a": np.zeros(3)}, batch_size=4, seed=0)
  with pytest.raises(ValueError, match="multiple of the number of hosts"):
    pipeline.per_host_batch_size(6, 4)
  padded = pipeline.pad_rows({"t": np.ones((5, 2), np.int32)}, 4, {"t": -100})
  assert padded["t"].shape == (8, 2) and np.all(padded["t"][5:] == -100)

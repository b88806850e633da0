"""The training tasks: their batches (a checkpointable train iterator, eval batches) and sizes.

  mqar: the in-memory MQAR generator (data/mqar.py); its test set is fixed for the run.
  lm:   packed text files (data/text.py, data/tokenizer.py) or token shards
        prepared beforehand (data/token_shards.py).

Their config fields are checked before a task is made (palimpsa_jax/run_config/base.py).
"""

import abc
from collections.abc import Iterator
import contextlib
import itertools
import os
from typing import Any

import ml_collections
import numpy as np

from palimpsa_jax.data import mqar as mqar_lib
from palimpsa_jax.data import pipeline
from palimpsa_jax.data import text as text_lib
from palimpsa_jax.data import token_shards
from palimpsa_jax.data import tokenizer as tokenizer_lib


class Task(abc.ABC):
  """Training batches (checkpointable iterator), evaluation batches, sizes.

  Every batch either yields holds its "targets" (IGNORE_INDEX where nothing is scored).
  """

  train_iterator: Any
  total_steps: int
  tokens_per_step: int

  @abc.abstractmethod
  def eval_batches(self) -> Iterator[dict[str, np.ndarray]]:
    """This host's evaluation batches (the same number on every host)."""


class MqarTask(Task):
  """MQAR from the in-memory generator; the test set is fixed for the run."""

  def __init__(self, config: ml_collections.ConfigDict):
    data = config.data
    shard_index, shard_count = pipeline.host_shard()
    generate = lambda num, seed: mqar_lib.multiquery_ar(
        vocab_size=data.vocab_size, num_examples=num,
        input_seq_len=config.seq_len, num_kv_pairs=data.num_kv_pairs,
        power_a=data.power_a, random_non_queries=data.random_non_queries,
        seed=seed)
    # Distinct streams for train and test, different for every seed.
    train_inputs, train_targets = generate(data.num_train_examples, 2 * config.seed)
    test_inputs, test_targets = generate(data.num_test_examples, 2 * config.seed + 1)
    per_host = pipeline.per_host_batch_size(config.batch_size, shard_count)
    # The loss reads the logits at the query positions only (steps.py).
    self.train_dataset = pipeline.array_dataset(
        {"tokens": train_inputs, "targets": train_targets,
         "positions": mqar_lib.target_positions(train_targets)},
        batch_size=per_host, seed=config.seed, shuffle=True, num_epochs=None,
        shard_index=shard_index, shard_count=shard_count)
    self.train_iterator = iter(self.train_dataset)
    steps_per_epoch = data.num_train_examples // config.batch_size
    self.total_steps = (config.total_steps if config.total_steps is not None
                        else config.num_epochs * steps_per_epoch)
    self.tokens_per_step = config.batch_size * config.seq_len
    test = pipeline.pad_rows(
        {"tokens": test_inputs, "targets": test_targets,
         "positions": mqar_lib.target_positions(test_targets)},
        config.eval_batch_size,
        {"tokens": 0, "targets": mqar_lib.IGNORE_INDEX, "positions": 0})
    self._eval_dataset = pipeline.array_dataset(
        test, batch_size=pipeline.per_host_batch_size(config.eval_batch_size,
                                                      shard_count),
        seed=0, shuffle=False, num_epochs=1, shard_index=shard_index,
        shard_count=shard_count)

  def eval_batches(self):
    return iter(self._eval_dataset)


class LmTask(Task):
  """Packed text from data/text.py, tokenised with data/tokenizer.py, or token
  shards prepared beforehand (data/token_shards.py)."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    data = config.data
    shard_index, shard_count = pipeline.host_shard()
    shards = token_shards.is_token_shards(data.train_files)
    # Refused here, before a tokenizer is trained into the workdir.
    if not shards:
      text_lib.require_text(data.train_files, "config.data.train_files")
    if data.eval_files and not token_shards.is_token_shards(data.eval_files):
      text_lib.require_text(data.eval_files, "config.data.eval_files")
    bpe_vocab = tokenizer_lib.bpe_vocab_size(data.tokenizer)
    if bpe_vocab is not None and bpe_vocab > config.model.vocab_size:
      raise text_lib.DataError(
          f"config.data.tokenizer={data.tokenizer!r} has more tokens than "
          f"config.model.vocab_size={config.model.vocab_size}; raise the model's "
          "vocabulary or use a smaller tokenizer.")
    if shards:
      tokenizer = token_shards.shard_tokenizer(data.train_files, data.tokenizer, workdir)
    else:
      trains_tokenizer = bpe_vocab is not None and not os.path.isfile(
          tokenizer_lib.bpe_tokenizer_path(workdir, bpe_vocab))
      tokenizer = tokenizer_lib.load_or_train_tokenizer(
          data.tokenizer, data.train_files, workdir)
    if tokenizer.vocab_size > config.model.vocab_size:
      raise ValueError(
          f"the tokenizer has {tokenizer.vocab_size} tokens but "
          f"config.model.vocab_size={config.model.vocab_size}; raise the model's "
          "vocabulary or use a smaller tokenizer.")

    per_host = pipeline.per_host_batch_size(config.batch_size, shard_count)
    if shards:
      token_shards.require_one_batch(data.train_files, config.seq_len, per_host,
                                     "config.data.train_files", shard_index, shard_count)
      self.train_dataset = token_shards.make_shard_dataset(
          data.train_files, config.seq_len, per_host, config.seed, shard_index, shard_count)
    else:
      try:
        text_lib.require_one_batch(data.train_files, tokenizer, config.seq_len, per_host,
                                   "config.data.train_files", shard_index, shard_count)
      except text_lib.DataError:
        if trains_tokenizer:  # else a rerun with more text would reuse this tokenizer
          with contextlib.suppress(FileNotFoundError):  # another host's removed it
            os.remove(tokenizer.path)
        raise
      self.train_dataset = text_lib.make_text_dataset(
          data.train_files, tokenizer, config.seq_len, per_host, config.seed,
          shard_index, shard_count)
    # Targets are added per batch (map keeps the iterator's checkpointed state as it was).
    self.train_dataset = self.train_dataset.map(with_lm_targets)
    self.train_iterator = iter(self.train_dataset)
    self.total_steps = config.total_steps
    self.tokens_per_step = config.batch_size * config.seq_len
    self._eval_dataset = None
    eval_per_host = pipeline.per_host_batch_size(config.eval_batch_size, shard_count)
    if data.eval_files and token_shards.is_token_shards(data.eval_files):
      # Refuses eval shards prepared with another tokenizer than the training data's.
      token_shards.shard_tokenizer(data.eval_files, tokenizer.path, workdir)
      self._eval_dataset = token_shards.make_shard_eval_dataset(
          data.eval_files, config.seq_len, eval_per_host, shard_index, shard_count)
    elif data.eval_files:
      self._eval_dataset = text_lib.make_text_eval_dataset(
          data.eval_files, tokenizer, config.seq_len, eval_per_host,
          shard_index, shard_count)
    if self._eval_dataset is not None:
      self._eval_dataset = self._eval_dataset.map(with_lm_targets)
    self._num_eval_batches = data.eval_batches

  def eval_batches(self):
    if self._eval_dataset is None:
      return iter(())
    # Every host must run the same number of eval steps: stop at the
    # configured count, or earlier only if the (sharded) data runs out.
    return itertools.islice(self._eval_dataset, self._num_eval_batches)


def with_lm_targets(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Adds next-token "targets" to a packed text batch.

  A target is IGNORE_INDEX at the last position, across document boundaries
  and on padding ("mask" 0); "mask" itself is consumed.
  """
  batch = dict(batch)
  mask = batch.pop("mask", None)
  targets, weights = text_lib.next_token_targets(
      batch["tokens"], batch["segment_ids"], mask)
  batch["targets"] = np.where(weights > 0, targets, mqar_lib.IGNORE_INDEX).astype(
      np.int32)
  return batch


def make_task(config: ml_collections.ConfigDict, workdir: str) -> Task:
  if config.task == "mqar":
    return MqarTask(config)
  return LmTask(config, workdir)

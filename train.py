r"""Trains a model from an ml_collections config; all logic is in palimpsa_jax.training.

  python train.py --config configs/mqar.py --workdir runs/mqar
  python train.py --config configs/mqar.py:model=mamba2,seq_len=128,num_kv_pairs=16 \
      --workdir runs/m2
  python train.py --config configs/lm.py:model=palimpsa_d,size=170m \
      --config.data.train_files='data/*.jsonl' --config.total_steps=1000 --workdir runs/lm
  python train.py --config configs/mqar.py --dry_run   # parameter table, then exit

A restarted command resumes from the latest checkpoint in --workdir. Ctrl-C (SIGINT) or
SIGTERM checkpoints the current step, says where, and exits (130 or 143). Compiled steps are kept in
JAX's persistent compilation cache (--compilation_cache_dir; empty turns it off). Multi-host:
pass --coordinator_address, --num_processes and --process_id (or rely on the
cluster's auto-detection with --distributed). A refused command (config, model, data, a workdir
of another run) prints one line and writes nothing; a write that fails mid-run (a full disk)
stops it with one line naming the last good checkpoint; --verbose shows their tracebacks.
"""

import time

_STARTED_AT = time.time()  # For perf/time_to_first_step_s; before the heavy imports.

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

from palimpsa_jax import user_errors

if __name__ == "__main__":  # a mistyped path is answered before the heavy imports below
  user_errors.precheck("train.py", sys.argv, config_flag="config", output_dirs=("workdir",))

from absl import app
from absl import flags
from absl import logging
from flax import nnx
import jax
from ml_collections import config_flags

from palimpsa_jax.models.summary import parameter_table
from palimpsa_jax.training import bookkeeping
from palimpsa_jax.training import compile_cache
from palimpsa_jax.training import config_overrides
from palimpsa_jax.training import state as state_lib
from palimpsa_jax.training import trainer
# pylint: enable=g-import-not-at-top,wrong-import-position

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (path[:args]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and config go here.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Print the parameter table and `params: <count>`, then exit.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() (auto-detected cluster).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_CACHE_DIR = compile_cache.define_flag()


def dry_run(config) -> None:
  """Prints the model's parameter table and, as the last line, `params: <count>`."""
  build = state_lib.run_model_fn(config)
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: build(nnx.Rngs(config.seed)))
  table, count = parameter_table(model)
  print(table)
  print(f"params: {count}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _COORDINATOR.value or _DISTRIBUTED.value:
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
  # Orbax logs every checkpoint step at INFO; keep the terminal for progress.
  if logging.get_verbosity() == logging.INFO:
    logging.set_verbosity(logging.WARNING)
  compile_cache.configure(_CACHE_DIR.value)
  config = _CONFIG.value
  if _DRY_RUN.value:
    dry_run(config)
    return
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required (except with --dry_run).")
  stop = bookkeeping.StopSignals()
  try:
    with stop:
      trainer.train_and_evaluate(config, _WORKDIR.value, started_at=_STARTED_AT,
                                 should_stop=stop)
  except bookkeeping.Interrupted as interrupted:
    print(interrupted, file=sys.stderr, flush=True)
    sys.exit(stop.exit_code)
  except KeyboardInterrupt:  # a second Ctrl-C, or one before training started
    print("interrupted; a rerun of the same command resumes from the latest checkpoint",
          file=sys.stderr, flush=True)
    sys.exit(stop.exit_code)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  user_errors.run_app("train.py", main, flags_parser=config_overrides.parse_flags)

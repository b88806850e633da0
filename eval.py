r"""Evaluates trained checkpoints with one suite and writes the results as JSON.

  python eval.py --suite mqar --workdir runs/mqar
  python eval.py --suite mqar --workdir runs/mqar --mqar_settings 128:16,256:32
  python eval.py --suite lm --checkpoint runs/lm --files 'data/valid/*.txt'
  python eval.py --suite lm --checkpoint runs/conv --files 'data/valid/*.txt'  (a conversion output)

Suites live in palimpsa_jax/evaluation/suites.py. The JSON goes to --output,
or by default to <first checkpoint's workdir>/eval_<suite>.json.
"""

import json
import os

from absl import app
from absl import flags
from absl import logging

from palimpsa_jax.evaluation.suites import OPTION_FIELDS
from palimpsa_jax.evaluation.suites import SUITES
from palimpsa_jax.run_config import values
from palimpsa_jax.training import checkpoint as checkpoint_lib
from palimpsa_jax.training import compile_cache
from palimpsa_jax.training import storage
from palimpsa_jax import user_errors

_SUITE = flags.DEFINE_enum("suite", None, list(SUITES), "Evaluation suite.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A train.py workdir (latest checkpoint).")
_CHECKPOINT = flags.DEFINE_multi_string(
    "checkpoint", [], "Workdirs, checkpoints/<step> folders or conversion outputs "
    "(python -m palimpsa_jax.conversion --dest); repeatable or comma-separated.")
_OUTPUT = flags.DEFINE_string("output", None, "JSON output path.")
_FILES = flags.DEFINE_string("files", None, "Held-out text files (glob) for lm / long_context.")
_TASKS = flags.DEFINE_list("tasks", None, "lm-eval tasks (commonsense).")
_INCLUDE_PATH = flags.DEFINE_string("include_path", None, "Extra lm-eval task YAMLs.")
_MAX_LENGTH = flags.DEFINE_integer("max_length", None, "Maximum sequence length.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Evaluation batch size.")
_LIMIT = flags.DEFINE_float("limit", None, "Examples per task (commonsense; for quick runs).")
_MQAR_SETTINGS = flags.DEFINE_string(
    "mqar_settings", None,
    "mqar: extra test settings SEQ_LEN:KV_PAIRS,... besides the trained one.")
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", None, "mqar: test examples per setting.")
_CACHE_DIR = compile_cache.define_flag()
_MESH_SEQUENCE = flags.DEFINE_integer(
    "mesh_sequence", None, "lm / long_context: split each row over this many devices "
    "(context parallelism, like train.py's config.mesh.sequence).")
for _flag in (_MAX_LENGTH, _BATCH_SIZE, _LIMIT, _NUM_EXAMPLES, _MESH_SEQUENCE):
  values.check_flag(_flag, OPTION_FIELDS[_flag.name])


def _checkpoints() -> list[str]:
  checkpoints = [_WORKDIR.value] if _WORKDIR.value else []
  for value in _CHECKPOINT.value:
    checkpoints.extend(c for c in value.split(",") if c)
  if not checkpoints:
    raise app.UsageError("give --workdir or --checkpoint.")
  return checkpoints


def default_output(suite: str, checkpoint: str) -> str:
  """<workdir>/eval_<suite>.json for a workdir or one of its checkpoints/<step>."""
  return os.path.join(checkpoint_lib.workdir_of(checkpoint), f"eval_{suite}.json")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Orbax logs every restore at INFO; keep the terminal for the results table.
  if logging.get_verbosity() == logging.INFO:
    logging.set_verbosity(logging.WARNING)
  compile_cache.configure(_CACHE_DIR.value)
  checkpoints = _checkpoints()
  output = _OUTPUT.value or default_output(_SUITE.value, checkpoints[0])
  # Refused before the work rather than after it (the suites write beside it too: a plot).
  user_errors.check_output_file(output, f"--output={output}" if _OUTPUT.value else
                                f"results go to {output} by default (--output changes it)")
  replaces = os.path.exists(output)
  options = {
      "suite": _SUITE.value, "checkpoint": checkpoints, "output": _OUTPUT.value,
      "files": _FILES.value, "tasks": _TASKS.value,
      "include_path": _INCLUDE_PATH.value, "max_length": _MAX_LENGTH.value,
      "batch_size": _BATCH_SIZE.value, "limit": _LIMIT.value,
      "mqar_settings": _MQAR_SETTINGS.value, "num_examples": _NUM_EXAMPLES.value,
      "mesh_sequence": _MESH_SEQUENCE.value,
  }
  results = SUITES[_SUITE.value](options)
  # A disk that fills or turns read-only during the work: one line (storage.WriteFailed).
  storage.write_whole(output, json.dumps(results, indent=2))
  print(f"{'replaced the earlier' if replaces else 'wrote'} {output}")


if __name__ == "__main__":
  flags.mark_flag_as_required("suite")
  user_errors.run_app("eval.py", main)

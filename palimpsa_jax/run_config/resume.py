"""What a resume may change: the saved config.json is the run's identity.

Every run-config field (base.py's schema, and config.model's) is in one of two classes:
  - MAY_CHANGE: it extends the run (more steps), only observes it (cadences of logging,
    evaluation and checkpoints, the early-stop threshold) or only places the same computation
    on the devices (mesh, microbatches, kernel implementation). A resume may change it; the
    change is recorded in the segment (training/run_summary.py), never in config.json.
  - everything else is the run's identity (model, optimizer, schedule, batch, data, seed, ...):
    a resume that changes it is refused, naming each such field.
config.args and config.finetune hold the config file's arguments; the fields derived from
them are what is compared, so they are not (NOT_COMPARED).

The learning-rate schedule's horizon is part of the identity: optimizer.decay_steps None means
"the planned steps", so on resume it is pinned to the saved run's planned steps (`pinned`), and
steps past that horizon train at the schedule's final rate.
"""

import json
from typing import Any

import ml_collections

from palimpsa_jax.run_config import base

# Field paths below config (a group name covers all of its fields).
EXTENDS = ("total_steps", "num_epochs")
OBSERVES = ("log_every_steps", "eval_every_steps", "checkpoint_every_steps", "keep_checkpoints",
            "checkpoint_every_minutes", "async_checkpointing", "log_diagnostics",
            "early_stop_accuracy")
# The same computation, placed otherwise: the mesh, microbatches (the same mean gradient),
# where the initial parameters are computed (step 0 only), and the model's implementation
# choices that compute the same function (the op's implementation, rematerialisation).
PLACES = ("grad_accum_steps", "device_batch", "init_on_host", "mesh", "model.implementation",
          "model.remat", "model.remat_saves")
MAY_CHANGE = EXTENDS + OBSERVES + PLACES
NOT_COMPARED = ("args", "finetune")
# The schema's fields that are the run's identity (config.model's are, except those above).
IDENTITY = ("task", "seed", "seq_len", "batch_size", "eval_batch_size", "init_from",
            "optimizer", "data", "model")


def _covered(path: str, prefixes: tuple[str, ...]) -> bool:
  return any(path == p or path.startswith(p + ".") for p in prefixes)


def may_change(path: str) -> bool:
  """Whether a resume may change the field at `path` ("optimizer.learning_rate")."""
  return _covered(path, MAY_CHANGE)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  flat = {}
  for key, value in tree.items():
    flat.update(_flat(value, f"{prefix}{key}."))
  return {k.rstrip("."): v for k, v in flat.items()}


def _as_saved(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """{field path: value} as config.json holds them (tuples become lists)."""
  return _flat(json.loads(config.to_json_best_effort()))


def planned_steps(config: ml_collections.ConfigDict) -> int:
  """The run's planned steps: total_steps, or num_epochs passes over the MQAR training set
  (data/tasks.py's MqarTask counts the same)."""
  if config.total_steps is not None:
    return config.total_steps
  return config.num_epochs * (config.data.num_train_examples // config.batch_size)


def horizon(config: ml_collections.ConfigDict) -> int:
  """The learning-rate schedule's horizon (optimizer.decay_steps, or the planned steps)."""
  decay = config.optimizer.decay_steps
  return decay if decay is not None else planned_steps(config)


def differences(saved: ml_collections.ConfigDict, given: ml_collections.ConfigDict
                ) -> tuple[dict[str, tuple[Any, Any]], dict[str, tuple[Any, Any]]]:
  """(refused, allowed): {field path: (saved value, given value)} of the fields that differ.

  Only fields both hold are compared: one that only config.json holds was removed from the
  code since, one it lacks was added since (another model kind differs in config.model.model).
  optimizer.decay_steps is compared as the horizon it sets (None given: the saved horizon).
  """
  old, new = _as_saved(saved), _as_saved(given)
  refused, allowed = {}, {}
  for path in sorted(old.keys() & new.keys()):
    if _covered(path, NOT_COMPARED) or path == "optimizer.decay_steps":
      continue
    if old[path] != new[path]:
      (allowed if may_change(path) else refused)[path] = (old[path], new[path])
  decay = given.optimizer.decay_steps
  if decay is not None and decay != horizon(saved):
    refused["optimizer.decay_steps"] = (horizon(saved), decay)
  return refused, allowed


def refusal(workdir: str, refused: dict[str, tuple[Any, Any]]) -> str:
  """The one-line refusal of a resume that changes the run's identity."""
  fields = [f"config.{path}={given!r} (saved: {saved!r})"
            for path, (saved, given) in refused.items()]
  if "model.model" in refused:  # another kind of model: its other fields follow from it
    fields = [f for f in fields if f.startswith("config.model.model=")]
  elif len(fields) > 6:
    fields = fields[:6] + [f"and {len(fields) - 6} more"]
  return (f"--workdir {workdir} holds a run with other settings: {', '.join(fields)}. "
          "A resume continues the saved run (its config.json): drop these changes to resume "
          "it as saved, or give another --workdir to start a new run.")


def pinned(given: ml_collections.ConfigDict, saved: ml_collections.ConfigDict
           ) -> ml_collections.ConfigDict:
  """`given` with the saved run's schedule horizon (optimizer.decay_steps) made explicit."""
  config = given.copy_and_resolve_references()
  config.optimizer.decay_steps = horizon(saved)
  return config


def schema_paths(task: str) -> list[str]:
  """Every field path of base.py's schema for `task` (config.model's are not listed there)."""
  groups = {"": base.FIELDS, "optimizer.": base.OPTIMIZER_FIELDS, "mesh.": base.MESH_FIELDS,
            "data.": base.DATA_FIELDS[task]}
  return [prefix + name for prefix, fields in groups.items() for name in fields]

"""What a resume may change (run_config/resume.py): the declared classes and the comparison."""

import importlib.util
import pathlib

import pytest

from palimpsa_jax.run_config import base
from palimpsa_jax.run_config import resume

REPO = pathlib.Path(__file__).parents[2]


def _mqar_config(arg: str | None = None):
  spec = importlib.util.spec_from_file_location("mqar", REPO / "configs" / "mqar.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def test_every_schema_field_is_classified_once():
  """A new field needs a deliberate choice: may a resume change it, or is it the run's?"""
  for task in base.TASKS:
    for path in resume.schema_paths(task):
      identity = any(path == p or path.startswith(p + ".") for p in resume.IDENTITY)
      assert resume.may_change(path) != identity, path
  model_fields = set(_mqar_config().model)
  for path in resume.MAY_CHANGE:
    if path.startswith("model."):
      assert path.split(".", 1)[1] in model_fields, path


def test_the_config_file_arguments_are_compared_through_the_fields_they_set():
  saved = _mqar_config()
  refused, allowed = resume.differences(saved, _mqar_config("batch_size=64,evals_per_epoch=2"))
  assert refused == {"batch_size": (32, 64)}  # args.batch_size is not compared itself
  assert set(allowed) == {"log_every_steps", "eval_every_steps", "checkpoint_every_steps"}
  refused, allowed = resume.differences(saved, _mqar_config("learning_rate=3e-3"))
  assert refused == {"optimizer.learning_rate": (1e-2, 3e-3)} and not allowed


def test_fields_of_other_code_versions_are_not_compared():
  saved, given = _mqar_config(), _mqar_config()
  saved.model.removed_since = 1
  given.model.added_since = 2
  assert resume.differences(saved, given) == ({}, {})


@pytest.mark.parametrize("decay, refused", [(None, {}), (2500, {}),
                                            (3000, {"optimizer.decay_steps": (2500, 3000)})])
def test_the_schedule_horizon_is_the_saved_one(decay, refused):
  saved = _mqar_config()  # 4 epochs of 625 steps
  given = _mqar_config("total_steps=5000")
  given.optimizer.decay_steps = decay
  assert resume.differences(saved, given)[0] == refused
  assert resume.pinned(given, saved).optimizer.decay_steps == 2500
  assert given.optimizer.decay_steps == decay  # the given config is not changed


def test_the_refusal_names_each_field_and_both_ways_out():
  message = resume.refusal("runs/x", {"batch_size": (32, 64),
                                      "optimizer.learning_rate": (0.01, 0.003)})
  assert message == (
      "--workdir runs/x holds a run with other settings: config.batch_size=64 (saved: 32), "
      "config.optimizer.learning_rate=0.003 (saved: 0.01). A resume continues the saved run "
      "(its config.json): drop these changes to resume it as saved, or give another --workdir "
      "to start a new run.")

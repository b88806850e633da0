"""The run config's one table of fields (palimpsa_jax/run_config/base.py) and the config files on it."""

import importlib.util
import json
import pathlib

import ml_collections
import pytest

from palimpsa_jax.run_config import base
from palimpsa_jax.run_config import config_args
from palimpsa_jax.training import checkpoint

REPO = pathlib.Path(__file__).resolve().parents[2]


def _config_file(name: str):
  spec = importlib.util.spec_from_file_location(f"{name}_config", REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _lm_config(arg: str = "size=tiny") -> ml_collections.ConfigDict:
  config = _config_file("lm").get_config(arg)
  config.data.train_files = "data/*.txt"
  return config


@pytest.mark.parametrize("task", base.TASKS)
def test_base_config_holds_every_field_with_its_default(task):
  config = base.base_config(task)
  groups = {"": base.FIELDS, "optimizer.": base.OPTIMIZER_FIELDS,
            "mesh.": base.MESH_FIELDS, "data.": base.DATA_FIELDS[task]}
  for prefix, fields in groups.items():
    group = config[prefix.rstrip(".")] if prefix else config
    for name, field in fields.items():
      expected = None if field.default is base.REQUIRED else field.default
      if name == "task":
        expected = task
      assert group[name] == expected, prefix + name
  assert set(config) == set(base.FIELDS) | {"optimizer", "mesh", "data"}
  with pytest.raises(ValueError, match="task must be one of"):
    base.base_config("vision")


@pytest.mark.parametrize("name, arg", [
    ("mqar", ""), ("mqar", "preset=paper,model=mamba2,seq_len=1024,num_kv_pairs=256"),
    ("lm", "size=tiny"), ("lm", "model=mamba2,size=170m"),
])
def test_config_files_set_every_required_field(name, arg):
  config = _lm_config(arg) if name == "lm" else _config_file(name).get_config(arg)
  base.validate(config)


@pytest.mark.parametrize("field, value, message", [
    ("seq_len", 1, "config.seq_len must be an int >= 2, got 1."),
    ("log_diagnostics", 1, "config.log_diagnostics must be True or False, got 1."),
    ("batch_size", True, "config.batch_size must be a positive int, got True."),
    ("early_stop_accuracy", 1.5, "config.early_stop_accuracy must be a number in (0, 1]"),
    ("early_stop_accuracy", 0.0, "config.early_stop_accuracy must be a number in (0, 1], or None"),
    ("total_steps", 0, "config.total_steps must be a positive int, or None (num_epochs passes)"),
    ("grad_accum_steps", 0, "config.grad_accum_steps must be a positive int, or None (auto"),
    ("optimizer.clip_norm", 0.0, "config.optimizer.clip_norm must be a positive number, or None"),
    ("optimizer.b2", 1.0, "config.optimizer.b2 must be a number in [0, 1), got 1.0."),
    ("optimizer.learning_rate", 0.0, "config.optimizer.learning_rate must be a positive number, "
     "got 0.0."),
    ("optimizer.end_fraction", 2.0, "config.optimizer.end_fraction must be a number in [0, 1]"),
    ("optimizer.decay_steps", 0, "config.optimizer.decay_steps must be a positive int, or None "
     "(total_steps)"),
    ("optimizer.learning_rate", "3e-3", "config.optimizer.learning_rate must be a positive"),
    ("mesh.tensor", 0, "config.mesh.tensor must be a positive int, or -1"),
    ("data.num_kv_pairs", None, "config.data.num_kv_pairs must be a positive int, got None."),
])
def test_a_bad_value_is_named_with_what_was_expected(field, value, message):
  config = _config_file("mqar").get_config()
  *groups, leaf = field.split(".")
  target = config[groups[0]] if groups else config
  with target.ignore_type():
    target[leaf] = value
  with pytest.raises(ValueError) as error:
    base.validate(config)
  assert str(error.value).startswith(message)


@pytest.mark.parametrize("name", ["mqar", "lm", "finetune"])
def test_every_config_argument_is_checked_by_a_field(name):
  module = _config_file(name)
  assert set(module.DEFAULTS) <= set(module.ARGUMENT_FIELDS)
  task = "lm" if name == "lm" else "mqar"
  own = {"lm": {"total_steps"}, "finetune": {"total_steps", "task"}}.get(name, set())
  for key, field in base.argument_fields(task).items():  # a field's argument: its own check
    if key in module.DEFAULTS and key not in own:
      assert module.ARGUMENT_FIELDS[key] is field, key


@pytest.mark.parametrize("name, arg, message", [
    ("mqar", "batch_size=0", "config argument batch_size=0 must be a positive int."),
    ("mqar", "evals_per_epoch=0", "config argument evals_per_epoch=0 must be a positive int."),
    ("mqar", "warmup_fraction=1.5", "config argument warmup_fraction=1.5 must be a number in "
     "[0, 1]."),
    ("mqar", "early_stop_accuracy=0", "config argument early_stop_accuracy=0 must be a number "
     "in (0, 1], or None (never stop early)."),
    ("mqar", "model=lstm", "config argument model=lstm must be one of ('palimpsa_d', "),
    ("lm", "preset=cpu,total_steps=0", "config argument total_steps=0 must be a positive int, "
     "or None (ceil(tokens / (batch_size * seq_len)))."),
    ("lm", "preset=cpu,seq_len=1", "config argument seq_len=1 must be an int >= 2."),
    ("lm", "tokens=-1", "config argument tokens=-1 must be a positive number."),
    ("finetune", "source=runs/x,evals=0", "config argument evals=0 must be a positive int."),
    ("finetune", "source=runs/x,learning_rate=0", "config argument learning_rate=0 must be a "
     "positive number."),
])
def test_a_refused_config_argument_says_what_its_field_expects(name, arg, message):
  with pytest.raises(config_args.ConfigArgumentError) as error:
    _config_file(name).get_config(arg)
  assert str(error.value).startswith(message)


def test_missing_and_unknown_fields_are_named():
  config = _config_file("mqar").get_config()
  del config.optimizer["clip_norm"]
  with pytest.raises(ValueError, match=r"^config.optimizer.clip_norm is missing; expected a "):
    base.validate(config)
  config = _config_file("mqar").get_config()
  config.log_every = 5
  with pytest.raises(ValueError, match=r"^config.log_every is not a config field; the fields "):
    base.validate(config)
  config = _lm_config()
  config.data.num_kv_pairs = 4  # an MQAR field in an LM config
  with pytest.raises(ValueError, match=r"^config.data.num_kv_pairs is not a config field"):
    base.validate(config)


def test_cross_field_checks():
  config = _lm_config()
  config.data.train_files = ""
  with pytest.raises(ValueError, match=r"^config.data.train_files must be the training text"):
    base.validate(config)
  config = _config_file("mqar").get_config("num_train_examples=16,batch_size=32")
  with pytest.raises(ValueError, match="num_train_examples=16 is smaller than config.batch_size"):
    base.validate(config)
  config = _config_file("mqar").get_config()
  config.num_epochs = 0
  with pytest.raises(ValueError, match=r"set config.total_steps \(> 0\) or config.num_epochs"):
    base.validate(config)


def _leaves(config: ml_collections.ConfigDict) -> dict[str, object]:
  """{field name: value} of the run config's fields (config.args and config.finetune aside)."""
  leaves = {}
  for key, value in config.items():
    if key in ("args", "finetune"):
      continue
    if isinstance(value, ml_collections.ConfigDict):
      leaves.update(_leaves(value))
    else:
      leaves[key] = value
  return leaves


@pytest.mark.parametrize("name, arg", [
    ("mqar", ""), ("mqar", "preset=paper,total_steps=7,early_stop_accuracy=0.5"),
    ("lm", "size=tiny"), ("lm", "size=170m,batch_size=64,learning_rate=1e-3"),
])
def test_an_argument_with_a_field_name_sets_that_field(name, arg):
  config = _config_file(name).get_config(arg)
  fields = _leaves(config)
  # An argument at None is "not set" (mqar's total_steps: num_epochs passes; num_heads and
  # head_v_dim: the mixer's own layout); the config file chooses the field then.
  shared = [k for k in config.args if k in fields and config.args[k] is not None]
  assert {"learning_rate", "batch_size", "seq_len"} <= set(shared)
  assert {k: fields[k] for k in shared} == {k: config.args[k] for k in shared}
  assert not set(config.args) & set(config_args.RENAMED_LM | config_args.RENAMED_FRACTION)


@pytest.mark.parametrize("name, old, new", [
    ("mqar", "lr=1e-3", "learning_rate"), ("mqar", "kv=8", "num_kv_pairs"),
    ("mqar", "impl=chunked", "implementation"), ("mqar", "warmup=0.1", "warmup_fraction"),
    ("lm", "size=tiny,steps=5", "total_steps"), ("lm", "size=tiny,warmup=10", "warmup_steps"),
    ("mqar", "mixer=mamba2", "model"), ("lm", "mixer=mamba2", "model"),
    ("finetune", "source=runs/conversion,mixer=mamba2", "model"),
])
def test_an_earlier_argument_name_is_refused_naming_the_new_one(name, old, new):
  with pytest.raises(config_args.ConfigArgumentError) as error:
    _config_file(name).get_config(old)
  key = old.rsplit(",", 1)[-1].split("=")[0]
  assert str(error.value) == f"config argument {key} is now called {new} (e.g. {new}=<value>)."


def test_a_removed_argument_is_refused_saying_why():
  with pytest.raises(config_args.ConfigArgumentError) as error:
    _config_file("mqar").get_config("head_loss=pallas_gpu")
  assert str(error.value) == (f"config argument head_loss was removed: "
                              f"{config_args.REMOVED['head_loss']}.")


def test_a_config_json_in_the_earlier_spelling_loads_under_todays_names(tmp_path):
  """config.json of an earlier version: config.args under the names since renamed."""
  config = _config_file("mqar").get_config("total_steps=7")
  saved = json.loads(config.to_json_best_effort())
  old_names = {new: old for old, new in config_args.RENAMED_FRACTION.items()}
  saved["args"] = {old_names.get(key, key): value for key, value in saved["args"].items()}
  assert saved["args"]["lr"] == 1e-2 and saved["args"]["steps"] == 7
  (tmp_path / "config.json").write_text(json.dumps(saved))
  loaded = checkpoint.load_config(str(tmp_path))
  assert loaded.args.to_dict() == config.args.to_dict()
  assert loaded.to_json_best_effort() == config.to_json_best_effort()
  lm = _config_file("lm").get_config("size=tiny")
  saved = json.loads(lm.to_json_best_effort())
  saved["args"]["warmup"] = saved["args"].pop("warmup_steps")
  assert base.from_saved(saved).args.warmup_steps == lm.args.warmup_steps


def test_a_config_json_that_chose_the_model_as_mixer_loads_as_today(tmp_path):
  """An MQAR config.json of an earlier version: args.mixer, the paper's layout as
  num_heads=0 / head_v_dim=0, and a model config with 0 for None and without the fields
  added since; it loads as the config made today."""
  config = _config_file("mqar").get_config("preset=paper,model=mamba2")
  assert config.args.num_heads is None and config.model.norm_groups is None
  saved = json.loads(config.to_json_best_effort())
  saved["args"]["mixer"] = saved["args"].pop("model")
  saved["args"].update(num_heads=0, head_v_dim=0)
  saved["model"].update(mlp_hidden_dim=0, norm_groups=0)
  for added in ("precision", "remat_saves", "scan_layers", "matmul_precision"):
    del saved["model"][added]
  (tmp_path / "config.json").write_text(json.dumps(saved))
  loaded = checkpoint.load_config(str(tmp_path))
  assert json.loads(loaded.to_json_best_effort()) == json.loads(config.to_json_best_effort())
  base.validate(loaded)
  loaded.model.norm_groups = 4  # as --config.model.norm_groups=4 does: the field is typed
  with pytest.raises(TypeError):
    loaded.model.norm_groups = "4"


def test_the_zeros_of_an_earlier_config_json_are_read_as_none():
  """Earlier versions wrote 0 (total_steps: -1) for a setting that is not set."""
  config = _config_file("mqar").get_config()
  saved = json.loads(config.to_json_best_effort())
  saved.update(total_steps=-1, grad_accum_steps=0, device_batch=0, early_stop_accuracy=0.0)
  saved["optimizer"].update(decay_steps=0, clip_norm=0.0)
  loaded = base.from_saved(saved)
  assert loaded.total_steps is None and loaded.grad_accum_steps is None
  assert loaded.device_batch is None and loaded.early_stop_accuracy is None
  assert loaded.optimizer.decay_steps is None and loaded.optimizer.clip_norm is None
  base.validate(loaded)
  saved.update(total_steps=7, grad_accum_steps=2, device_batch=4, early_stop_accuracy=0.9)
  saved["optimizer"].update(decay_steps=9, clip_norm=0.5)
  loaded = base.from_saved(saved)  # set values stay
  assert (loaded.total_steps, loaded.grad_accum_steps, loaded.device_batch) == (7, 2, 4)
  assert (loaded.early_stop_accuracy, loaded.optimizer.decay_steps) == (0.9, 9)
  assert loaded.optimizer.clip_norm == 0.5


def test_a_none_setting_takes_a_value_of_its_type_from_the_command_line():
  config = base.base_config("mqar")
  config.total_steps = 5  # as --config.total_steps=5 does: the field is typed
  config.optimizer.decay_steps = 9
  with pytest.raises(TypeError):
    config.total_steps = "5"
  assert _config_file("mqar").get_config("early_stop_accuracy=none").early_stop_accuracy is None

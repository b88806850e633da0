"""Fine-tuning a converted model (the output of `python -m palimpsa_jax.conversion`).

  python -m palimpsa_jax.conversion --source runs/mamba2 --dest runs/conv \
      --layers auto:1 --init paper
  python train.py --config configs/finetune.py:source=runs/conv,total_steps=200,\
learning_rate=3e-4,new_params_only_steps=50 --workdir runs/conv

<source> must be a "paper" init conversion: a "zero" init one is an equivalence
check (it computes the source function exactly, and its new parameters have
zero gradient, so it cannot learn metaplasticity) and is rejected.
The model config comes from <source>/conversion.json and the first run starts
at step 0 from <source>/converted with a fresh optimizer (config.init_from);
later runs in the same workdir resume from its own checkpoints. The data and
the rest of the training setup come from configs/<task>.py: every argument not
listed in DEFAULTS below is passed to it (e.g. seq_len=64,num_kv_pairs=8 for MQAR).
Keep that file's seed to evaluate on the pretraining run's MQAR test set.
"""

import importlib.util
import os
import pathlib

import ml_collections

from palimpsa_jax.conversion import checkpoint
from palimpsa_jax.run_config import base
from palimpsa_jax.run_config import config_args
from palimpsa_jax.run_config import values

DEFAULTS = dict(
    source="",                # conversion output directory (required)
    task="mqar",              # base config: configs/<task>.py
    total_steps=200,          # a short schedule
    learning_rate=3e-4,       # lower than pretraining (configs/mqar.py: 1e-2 cpu, 1e-3 paper)
    warmup_fraction=0.05,     # fraction of steps
    end_fraction=0.1,         # cosine to 10% of the peak
    new_params_only_steps=0,  # first steps train only beta_down/up, b_scale
    evals=4,                  # evaluations over the run
)

# What each argument accepts: the run-config field it sets, else its own.
ARGUMENT_FIELDS = {
    **base.argument_fields("mqar"),
    "source": values.Field("", (str,), bool, "a conversion output directory"),
    "task": values.one_of("mqar", base.TASKS),
    "total_steps": values.positive(200),
    "evals": values.positive(),
}


def _base_config(task: str, arg: str) -> ml_collections.ConfigDict:
  path = pathlib.Path(__file__).parent / f"{task}.py"
  if not path.exists():
    raise ValueError(f"task={task!r} needs {path}, which does not exist.")
  spec = importlib.util.spec_from_file_location(f"{task}_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  items = [item for item in (arg or "").split(",") if item.strip()]
  own = [i for i in items if i.split("=", 1)[0].strip() in DEFAULTS]
  rest = [i for i in items if i not in own]
  args = config_args.parse_config_arg(",".join(own), fields=ARGUMENT_FIELDS, **DEFAULTS)
  if not args.source:
    raise ValueError("configs/finetune.py needs source=<conversion output directory>.")
  if not 0 <= args.new_params_only_steps <= args.total_steps:
    raise ValueError(
        f"new_params_only_steps must be in [0, total_steps={args.total_steps}], got "
        f"{args.new_params_only_steps}.")

  config = _base_config(args.task, ",".join(rest))
  config.model, info = checkpoint.read_conversion(args.source)
  if info.get("init") == "zero":
    raise ValueError(
        f"source={args.source!r} is a --init zero conversion: an equivalence check "
        "(beta == 0 and every new parameter has zero gradient), which fine-tuning "
        "cannot make metaplastic; convert again with --init paper.")
  config.init_from = os.path.abspath(args.source)
  config.finetune = args
  config.total_steps = args.total_steps
  config.num_epochs = 0
  config.early_stop_accuracy = None  # same number of steps for every model compared
  config.log_every_steps = max(1, args.total_steps // 20)
  config.eval_every_steps = max(1, args.total_steps // args.evals)
  config.checkpoint_every_steps = args.total_steps
  config.optimizer.learning_rate = args.learning_rate
  config.optimizer.warmup_fraction = args.warmup_fraction
  config.optimizer.end_fraction = args.end_fraction
  config.optimizer.new_params_only_steps = args.new_params_only_steps
  return config

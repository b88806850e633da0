r"""Command line: the authors' PyTorch Palimpsa-D and MetaMamba2 models, in and out.

  python -m palimpsa_jax.conversion.torch_models import --source hf/palimpsa-170m \
      --dest runs/p170
  python train.py --config configs/finetune.py:source=runs/p170,task=lm --workdir runs/p170
  python -m palimpsa_jax.conversion.torch_models export --checkpoint runs/p170 \
      --dest hf/p170-finetuned

import writes a conversion destination (conversion.json + converted/) from the
authors' config.json + *.safetensors, with numpy only; export writes
config.json + model.safetensors for their `from_pretrained` from a conversion
destination or a train.py workdir. See torch_checkpoints.py and
docs/torch_models.md.
"""

from absl import app
from absl import flags
from absl import logging

from palimpsa_jax.conversion import torch_checkpoints
from palimpsa_jax import user_errors

COMMANDS = ("import", "export")

_SOURCE = flags.DEFINE_string("source", None, "import: the authors' checkpoint directory "
                              "(config.json + *.safetensors).")
_DEST = flags.DEFINE_string("dest", None, "import: conversion destination to create; "
                            "export: directory for config.json + model.safetensors.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "export: a conversion destination or a "
                                  "train.py workdir (or its checkpoints/<step>).")
_DTYPE = flags.DEFINE_string("dtype", "float32", "import: compute dtype of our model.")


def main(argv):
  if len(argv) != 2 or argv[1] not in COMMANDS:
    raise app.UsageError(f"expected one command, {' or '.join(COMMANDS)}; got {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # Orbax logs every read and write at INFO.
  if not _DEST.value:
    raise app.UsageError("--dest is required")
  if argv[1] == "import":
    if not _SOURCE.value:
      raise app.UsageError("import needs --source")
    torch_checkpoints.import_checkpoint(_SOURCE.value, _DEST.value, dtype=_DTYPE.value)
  else:
    if not _CHECKPOINT.value:
      raise app.UsageError("export needs --checkpoint")
    torch_checkpoints.export_checkpoint(_CHECKPOINT.value, _DEST.value)


if __name__ == "__main__":
  user_errors.run_app("torch_models", main)

r"""Converts a pretrained Mamba2 / NotPalimpsa model into Palimpsa (docs/models.md, conversion).

  python -m palimpsa_jax.conversion --source runs/mamba2 --dest runs/conv \
      --layers auto:1 --init paper
  python -m palimpsa_jax.conversion --source hf/mamba2-130m --dest runs/m130 \
      --layers auto:8 --calibration_files 'data/*.jsonl'
  python train.py --config configs/finetune.py:source=runs/conv --workdir runs/conv
"""

from absl import app
from absl import flags
from absl import logging

from palimpsa_jax.conversion import command
from palimpsa_jax import user_errors

_SOURCE = flags.DEFINE_string(
    "source", None, "train.py workdir (or checkpoints/<step>), or Hugging Face Mamba2 "
    "safetensors (a file or a directory, transformers or mamba_ssm layout).")
_DEST = flags.DEFINE_string("dest", None, "Output directory (conversion.json + converted/).")
_LAYERS = flags.DEFINE_string(
    "layers", None, "auto:N (the N layers with the largest memory window), i,j,k, or none "
    "(an unconverted copy, the fine-tuning control).")
_INIT = flags.DEFINE_enum(
    "init", "paper", ["paper", "zero"],
    "New parameters: paper (the fine-tuning starting point), or zero: beta == 0, an "
    "equivalence check that computes the source function exactly and cannot learn "
    "metaplasticity (every new parameter has zero gradient; configs/finetune.py "
    "refuses it).")
_SEED = flags.DEFINE_integer("seed", 0, "Initialisation seed of the new parameters.")
_CALIBRATION_FILES = flags.DEFINE_string(
    "calibration_files", None, "Text files (glob) on which dt is measured for auto:N.")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", None, "tokenizer.json for --calibration_files (default: beside --source).")
_CALIBRATION_ROWS = flags.DEFINE_integer("calibration_rows", 8, "Calibration batch rows.")
_CALIBRATION_SEQ_LEN = flags.DEFINE_integer("calibration_seq_len", 512,
                                            "Calibration sequence length.")
_NUM_GROUPS = flags.DEFINE_integer(
    "num_groups", None, "B/C groups of a Hugging Face checkpoint whose config.json lacks "
    "them (default 1).")
_DTYPE = flags.DEFINE_string("dtype", None, "Compute dtype of the converted model.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # Orbax logs every read and write at INFO.
  tokens = None
  if _CALIBRATION_FILES.value:
    tokens = command.calibration_batch(
        _CALIBRATION_FILES.value, _TOKENIZER.value or command.default_tokenizer(_SOURCE.value),
        _CALIBRATION_SEQ_LEN.value, _CALIBRATION_ROWS.value)
  command.run_conversion(
      _SOURCE.value, _DEST.value, _LAYERS.value, _INIT.value, seed=_SEED.value,
      calibration_tokens=tokens, num_groups=_NUM_GROUPS.value, dtype=_DTYPE.value)


if __name__ == "__main__":
  flags.mark_flags_as_required(["source", "dest", "layers"])
  user_errors.run_app("conversion", main)

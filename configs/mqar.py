"""MQAR (multi-query associative recall): the project's main job.

  python train.py --config configs/mqar.py --workdir runs/mqar
  python train.py --config configs/mqar.py:preset=paper,model=mamba2,seq_len=1024,\
num_kv_pairs=256,learning_rate=2.15e-3 --workdir runs/mqar_mamba2_1024

The default (preset=cpu, no arguments) is a small CPU setting in which
Palimpsa-D reaches >= 99% test accuracy within minutes on two CPU cores
(README.md gives the measured time): sequence 32 with 4 pairs, a 64-token
vocabulary, d_model 64 and 4 heads of 16 x 16 state, learning rate 1e-2. preset=paper selects
docs/models.md, MQAR:
vocabulary 8192, d_model 128, 8 heads (K=16, V=32), 100k/3k examples, batch 128
(64 at length >= 1024), up to 60 epochs, early stop at 99%. Any argument given
explicitly overrides the preset. total_steps=N trains N steps instead of `num_epochs`
passes; warmup_fraction is a fraction of the steps the run actually takes. An argument that
sets a run-config field has that field's name (palimpsa_jax/run_config/config_args.py); preset,
model (a mixer of palimpsa_jax/models/registry.py), evals_per_epoch, num_heads and head_v_dim
(none: the paper's layout) have none.
precision=rank1 runs Fast Palimpsa (palimpsa_d, meta_mamba2; docs/fast_palimpsa.md) with
chunk_size=C steps per chunk.
"""

import ml_collections
from ml_collections import config_dict

from palimpsa_jax import models
from palimpsa_jax.data import mqar as mqar_data
from palimpsa_jax.models import config as model_fields
from palimpsa_jax.models import registry
from palimpsa_jax.run_config import base
from palimpsa_jax.run_config import config_args
from palimpsa_jax.run_config import values


DEFAULTS = dict(
    preset="cpu",
    model=registry.DEFAULT,
    seq_len=32,
    num_kv_pairs=4,
    vocab_size=64,
    d_model=64,
    # Heads of K=16 and V=head_v_dim (None: 32) of the mixers with that head layout;
    # None: the paper's layout (8 heads, K=16, V=32).
    num_heads=ml_collections.FieldReference(4, field_type=int),
    head_v_dim=ml_collections.FieldReference(16, field_type=int),
    num_train_examples=20_000,
    num_test_examples=1_000,
    batch_size=32,
    num_epochs=4,
    total_steps=config_dict.placeholder(int),  # None: num_epochs passes over the training set.
    learning_rate=1e-2,
    warmup_fraction=0.05,  # Fraction of the run's steps.
    seed=0,
    power_a=0.01,
    random_non_queries=False,
    early_stop_accuracy=ml_collections.FieldReference(0.99, field_type=float),  # none: never.
    evals_per_epoch=6,
    dtype="float32",
    implementation="auto",
    # The model's matmul precision (models' config.matmul_precision): "default" (XLA's
    # choice: TF32 for float32 on recent NVIDIA GPUs), "float32", "tensorfloat32" or
    # "bfloat16" (bfloat16 products, float32 accumulation). Opt-in; the op keeps its own.
    matmul_precision="default",
    precision="exact",  # "rank1": Fast Palimpsa.
    chunk_size=64,  # Chunk of the chunked op; with precision=rank1 the approximation's.
)

# The paper's setting (docs/models.md, MQAR); arguments given explicitly win.
PAPER = dict(
    seq_len=512,
    num_kv_pairs=128,
    vocab_size=8192,
    d_model=128,
    num_heads=None,
    head_v_dim=None,
    num_train_examples=100_000,
    num_test_examples=3_000,
    batch_size=128,
    num_epochs=60,
    learning_rate=1e-3,
    warmup_fraction=0.05,
    evals_per_epoch=1,
)


# What each argument accepts: the run-config or model-config field it sets, else its own.
ARGUMENT_FIELDS = {
    **model_fields.FIELDS, **base.argument_fields("mqar"),
    "preset": values.one_of("cpu", ("cpu", "paper")),
    "num_heads": values.or_none(values.positive(), "the paper's layout"),
    "head_v_dim": values.or_none(values.positive(), "32"),
    "evals_per_epoch": values.positive(),
}


def model_config(args: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The model's MQAR config: 2 layers, no MLP, no positions, small forget gates."""
  overrides = dict(dtype=args.dtype, implementation=args.implementation,
                   matmul_precision=args.matmul_precision, precision=args.precision,
                   chunk_size=args.chunk_size)
  kind = registry.KINDS[registry.mixer(args.model).kind]
  if {"num_heads", "head_v_dim"} <= set(kind.fields) and args.num_heads is not None:
    overrides.update(num_heads=args.num_heads,
                     head_v_dim=32 if args.head_v_dim is None else args.head_v_dim)
  return models.mqar_model_config(args.model, d_model=args.d_model,
                                  vocab_size=args.vocab_size, **overrides)


def parse_args(arg: str | None) -> ml_collections.ConfigDict:
  """Arguments with the preset's values under the explicitly given ones."""
  args = config_args.parse_config_arg(arg, fields=ARGUMENT_FIELDS, **DEFAULTS)
  if args.preset == "paper":
    given = config_args.given_keys(arg)
    for key, value in PAPER.items():
      if key not in given:
        args[key] = value
    if "batch_size" not in given and args.seq_len >= 1024:
      args.batch_size = 64
  mqar_data.check_setting(args.seq_len, args.num_kv_pairs, args.vocab_size)
  return args


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The MQAR run: palimpsa_jax/run_config/base.py's fields, set from the arguments."""
  args = parse_args(arg)
  config = base.base_config("mqar")
  config.args = args
  config.model = model_config(args)
  config.seed = args.seed
  config.seq_len = args.seq_len
  config.batch_size = args.batch_size
  config.eval_batch_size = max(args.batch_size, 128)
  steps_per_epoch = args.num_train_examples // args.batch_size
  config.num_epochs = args.num_epochs
  config.total_steps = args.total_steps  # None: num_epochs passes over the training set.
  config.log_every_steps = max(1, steps_per_epoch // 10)
  config.eval_every_steps = max(1, steps_per_epoch // args.evals_per_epoch)
  config.checkpoint_every_steps = max(1, steps_per_epoch)
  config.keep_checkpoints = 2
  config.early_stop_accuracy = args.early_stop_accuracy

  config.data.vocab_size = args.vocab_size
  config.data.num_kv_pairs = args.num_kv_pairs
  config.data.num_train_examples = args.num_train_examples
  config.data.num_test_examples = args.num_test_examples
  config.data.power_a = args.power_a
  config.data.random_non_queries = args.random_non_queries

  config.optimizer.learning_rate = args.learning_rate
  config.optimizer.warmup_fraction = args.warmup_fraction  # Of the run's actual steps.
  return config

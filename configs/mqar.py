"""MQAR (multi-query associative recall): the project's main job.

  python train.py --config configs/mqar.py --workdir runs/mqar
  python train.py --config configs/mqar.py:preset=paper,mixer=mamba2,seq_len=1024,kv=256,lr=2.15e-3 \
      --workdir runs/mqar_mamba2_1024

The default (preset=cpu, no arguments) is a small CPU setting in which
Palimpsa-D reaches >= 99% test accuracy within minutes on two CPU cores
(README.md gives the measured time): sequence 32 with 4 pairs, a 64-token
vocabulary, d_model 64 and 4 heads of 16 x 16 state, lr 1e-2. preset=paper selects docs/models.md, MQAR:
vocabulary 8192, d_model 128, 8 heads (K=16, V=32), 100k/3k examples, batch 128
(64 at length >= 1024), up to 60 epochs, early stop at 99%. Any argument given
explicitly overrides the preset. steps=N trains N steps instead of `epochs`
passes; warmup is a fraction of the steps the run actually takes.
precision=rank1 runs Fast Palimpsa (palimpsa_d, meta_mamba2; docs/fast_palimpsa.md) with
chunk_size=C steps per chunk.
"""

import math

import ml_collections

from palimpsa_jax import models
from palimpsa_jax.configs import base
from palimpsa_jax.configs import config_args

MIXERS = ("palimpsa_d", "not_palimpsa", "meta_mamba2", "mamba2",
          "gated_deltanet", "mesanet", "transformer")
# Mixers whose head layout (heads, K, V) the `heads` / `head_v` args change.
_DELTA_MIXERS = ("palimpsa_d", "not_palimpsa", "gated_deltanet", "mesanet")

DEFAULTS = dict(
    preset="cpu",
    mixer="palimpsa_d",
    seq_len=32,
    kv=4,
    vocab=64,
    d_model=64,
    heads=4,  # 0: the paper's layout (8 heads, K=16, V=32).
    head_v=16,
    examples=20_000,
    test_examples=1_000,
    batch=32,
    epochs=4,
    steps=0,  # 0: epochs passes over the training set.
    lr=1e-2,
    warmup=0.05,  # Fraction of the run's steps.
    seed=0,
    power_a=0.01,
    random_non_queries=False,
    early_stop=0.99,
    evals_per_epoch=6,
    dtype="float32",
    impl="auto",
    # The model's matmul precision (models' config.matmul_precision): "default" (XLA's
    # choice: TF32 for float32 on recent NVIDIA GPUs), "float32", "tensorfloat32" or
    # "bfloat16" (bfloat16 products, float32 accumulation). Opt-in; the op keeps its own.
    matmul="default",
    precision="exact",  # "rank1": Fast Palimpsa.
    chunk_size=64,  # Chunk of the chunked op; with precision=rank1 the approximation's.
)

# The paper's setting (docs/models.md, MQAR); arguments given explicitly win.
PAPER = dict(
    seq_len=512,
    kv=128,
    vocab=8192,
    d_model=128,
    heads=0,
    head_v=0,
    examples=100_000,
    test_examples=3_000,
    batch=128,
    epochs=60,
    lr=1e-3,
    warmup=0.05,
    evals_per_epoch=1,
)


def model_config(args: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The mixer's MQAR model: 2 layers, no MLP, no positions, small forget gates."""
  overrides = dict(dtype=args.dtype, implementation=args.impl, matmul_precision=args.matmul,
                   precision=args.precision, chunk_size=args.chunk_size)
  if args.mixer in _DELTA_MIXERS and args.heads:
    overrides.update(num_heads=args.heads, head_v_dim=args.head_v or 32)
  if args.mixer in ("meta_mamba2", "mamba2"):
    # 2 * d_model / 32 heads of P=32; B/C groups must divide the heads.
    overrides.update(num_groups=math.gcd(8, max(1, 2 * args.d_model // 32)))
  return models.mqar_model_config(args.mixer, d_model=args.d_model,
                                  vocab_size=args.vocab, **overrides)


def parse_args(arg: str | None) -> ml_collections.ConfigDict:
  """Arguments with the preset's values under the explicitly given ones."""
  args = config_args.parse_config_arg(arg, **DEFAULTS)
  if args.preset not in ("cpu", "paper"):
    raise ValueError(f"preset must be 'cpu' or 'paper', got {args.preset!r}.")
  if args.preset == "paper":
    given = config_args.given_keys(arg)
    for key, value in PAPER.items():
      if key not in given:
        args[key] = value
    if "batch" not in given and args.seq_len >= 1024:
      args.batch = 64
  if args.mixer not in MIXERS:
    raise ValueError(f"mixer must be one of {MIXERS}, got {args.mixer!r}.")
  if args.matmul not in models.language_model.MATMUL_PRECISIONS:
    raise ValueError(f"matmul must be one of {sorted(models.language_model.MATMUL_PRECISIONS)}, "
                     f"got {args.matmul!r}.")
  if args.steps < 0:
    raise ValueError(f"steps must be >= 0 (0: `epochs` passes), got {args.steps}.")
  return args


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The MQAR run: palimpsa_jax/configs/base.py's fields, set from the arguments."""
  args = parse_args(arg)
  config = base.base_config("mqar")
  config.args = args
  config.model = model_config(args)
  config.seed = args.seed
  config.seq_len = args.seq_len
  config.batch_size = args.batch
  config.eval_batch_size = max(args.batch, 128)
  steps_per_epoch = args.examples // args.batch
  config.num_epochs = args.epochs
  config.total_steps = args.steps or -1  # -1: num_epochs passes over the training set.
  config.log_every_steps = max(1, steps_per_epoch // 10)
  config.eval_every_steps = max(1, steps_per_epoch // args.evals_per_epoch)
  config.checkpoint_every_steps = max(1, steps_per_epoch)
  config.keep_checkpoints = 2
  config.early_stop_accuracy = args.early_stop

  config.data.vocab_size = args.vocab
  config.data.num_kv_pairs = args.kv
  config.data.num_train_examples = args.examples
  config.data.num_test_examples = args.test_examples
  config.data.power_a = args.power_a
  config.data.random_non_queries = args.random_non_queries

  config.optimizer.learning_rate = args.lr
  config.optimizer.warmup_fraction = args.warmup  # Of the run's actual steps.
  return config

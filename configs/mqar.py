"""MQAR (multi-query associative recall): the project's main job.

  python train.py --config configs/mqar.py --workdir runs/mqar
  python train.py --config configs/mqar.py:mixer=palimpsa_d,seq_len=512,kv=128,\
vocab=8192,examples=100000,test_examples=3000,batch=128,epochs=60,lr=1e-3 \
--workdir runs/mqar_512

The default (no arguments) is a small CPU setting in which Palimpsa-D reaches
>= 99% test accuracy in a few minutes on two CPU cores (docs/main_job.md gives
the measured time). The paper's settings (SPEC.md section 6) are arguments.
"""

import ml_collections

from palimpsa_jax.training import config_args

MIXERS = ("palimpsa_d", "not_palimpsa", "meta_mamba2", "mamba2",
          "gated_deltanet", "transformer")

DEFAULTS = dict(
    mixer="palimpsa_d",
    seq_len=64,
    kv=8,
    vocab=256,
    d_model=64,
    examples=20_000,
    test_examples=1_000,
    batch=64,
    epochs=16,
    lr=3e-3,
    warmup=0.05,
    seed=0,
    power_a=0.01,
    random_non_queries=False,
    early_stop=0.99,
    dtype="float32",
    evals_per_epoch=2,
)


def model_config(args: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The mixer's MQAR model: 2 layers, no MLP, no positions, small forget gates."""
  from palimpsa_jax import models  # pylint: disable=g-import-not-at-top
  return models.mqar_model_config(args.mixer, d_model=args.d_model,
                                  vocab_size=args.vocab, dtype=args.dtype)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = config_args.parse_config_arg(arg, **DEFAULTS)
  if args.mixer not in MIXERS:
    raise ValueError(f"mixer must be one of {MIXERS}, got {args.mixer!r}.")
  config = ml_collections.ConfigDict()
  config.task = "mqar"
  config.args = args
  config.model = model_config(args)
  config.seed = args.seed
  config.seq_len = args.seq_len
  config.batch_size = args.batch
  config.eval_batch_size = max(args.batch, 128)
  config.grad_accum_steps = 1
  steps_per_epoch = args.examples // args.batch
  config.num_epochs = args.epochs
  config.total_steps = -1  # -1: num_epochs passes over the training set.
  config.log_every_steps = max(1, steps_per_epoch // 10)
  config.eval_every_steps = max(1, steps_per_epoch // args.evals_per_epoch)
  config.checkpoint_every_steps = max(1, steps_per_epoch)
  config.keep_checkpoints = 2
  config.async_checkpointing = True
  config.early_stop_accuracy = args.early_stop

  config.data = ml_collections.ConfigDict()
  config.data.vocab_size = args.vocab
  config.data.num_kv_pairs = args.kv
  config.data.num_train_examples = args.examples
  config.data.num_test_examples = args.test_examples
  config.data.power_a = args.power_a
  config.data.random_non_queries = args.random_non_queries

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.learning_rate = args.lr
  config.optimizer.warmup_steps = int(args.warmup * steps_per_epoch * args.epochs)
  config.optimizer.decay_steps = 0  # 0: the whole run.
  config.optimizer.end_fraction = 0.0
  config.optimizer.b1 = 0.9
  config.optimizer.b2 = 0.999
  config.optimizer.eps = 1e-8
  config.optimizer.weight_decay = 0.1
  config.optimizer.clip_norm = 1.0

  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1
  config.mesh.fsdp = 1
  config.mesh.tensor = 1
  config.mesh.rules = ()
  return config

"""Language modelling on local text files (packed documents).

  python train.py --config configs/lm.py:model=palimpsa_d,size=170m --workdir runs/lm \
      --config.data.train_files='data/train/*.jsonl' \
      --config.data.eval_files='data/valid/*.jsonl' \
      --config.data.tokenizer=/path/to/tokenizer.json

Arguments: model (palimpsa_d, not_palimpsa, meta_mamba2, mamba2, gated_deltanet,
transformer), size (tiny, 170m, 760m, 2.7b), and the common run knobs below.
Defaults follow the paper's recipe (SPEC.md section 5): AdamW eps 1e-15, weight
decay 0.1, 2000 warmup steps, cosine to 10%, clipping 1.0, context 4096,
0.5M tokens per step. The tokenizer defaults to a byte-level BPE with the
model's vocabulary size, trained on the training files ("bpe:<vocab>").
"""

import ml_collections

from palimpsa_jax.training import config_args

DEFAULTS = dict(
    model="palimpsa_d",
    size="170m",
    seq_len=4096,
    batch=128,
    steps=30_000,
    lr=3e-3,
    warmup=2000,
    seed=0,
    dtype="bfloat16",
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = config_args.parse_config_arg(arg, **DEFAULTS)
  from palimpsa_jax import models  # pylint: disable=g-import-not-at-top
  config = ml_collections.ConfigDict()
  config.task = "lm"
  config.args = args
  config.model = models.model_config(args.model, args.size, dtype=args.dtype)
  config.seed = args.seed
  config.seq_len = args.seq_len
  config.batch_size = args.batch  # Global, in sequences.
  config.eval_batch_size = args.batch
  config.grad_accum_steps = 1
  config.total_steps = args.steps
  config.num_epochs = 0
  config.log_every_steps = 50
  config.eval_every_steps = 1000
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 3
  config.async_checkpointing = True
  config.log_diagnostics = True  # Mixer statistics per layer at eval steps.
  # Initial parameters computed on the CPU, then sharded: "auto" (on GPU/TPU,
  # whose compilers take minutes for the per-parameter random init), True, False.
  config.init_on_host = ml_collections.FieldReference("auto", field_type=object)
  config.early_stop_accuracy = 0.0  # 0: never stop early.

  config.data = ml_collections.ConfigDict()
  config.data.train_files = ""  # Required: glob(s) of .txt/.jsonl/.parquet/ArrayRecord.
  config.data.eval_files = ""  # Optional held-out files.
  config.data.eval_batches = 20
  config.data.tokenizer = f"bpe:{config.model.vocab_size}"

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.learning_rate = args.lr
  config.optimizer.warmup_steps = args.warmup
  config.optimizer.decay_steps = 0  # 0: total_steps.
  config.optimizer.end_fraction = 0.1
  config.optimizer.b1 = 0.9
  config.optimizer.b2 = 0.95
  config.optimizer.eps = 1e-15
  config.optimizer.weight_decay = 0.1
  config.optimizer.clip_norm = 1.0

  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = 1
  config.mesh.fsdp = -1
  config.mesh.tensor = 1
  config.mesh.rules = ()
  return config

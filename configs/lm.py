"""Language modelling on local text files (packed documents).

  python train.py --config configs/lm.py:model=palimpsa_d,size=170m --workdir runs/lm \
      --config.data.train_files='data/train/*.jsonl' \
      --config.data.eval_files='data/valid/*.jsonl' \
      --config.data.tokenizer=/path/to/tokenizer.json

Arguments: model (a mixer name of palimpsa_jax/models/registry.py, as in configs/mqar.py),
size (tiny, 170m, 760m, 2.7b), and the common run knobs below.
Defaults follow the paper's recipe (docs/models.md, sizes and recipe): AdamW eps 1e-15, weight
decay 0.1, 2000 warmup steps, cosine to 10%, clipping 1.0, context 4096,
batch 128 (128 x 4096 = 0.52M tokens per step). Per size (SIZE_DEFAULTS):
  170m: lr 3e-3,    15B tokens -> 28,611 steps;
  760m: lr 1.25e-3, 30B tokens -> 57,221 steps;
  2.7b: lr 8e-4,    30B tokens -> 57,221 steps (the paper gives no 2.7B recipe, the
        paper converts a pretrained model; lr from the GPT-3 / Mamba scaling);
  tiny: a smoke-test run: context 512, batch 16, lr 3e-3, 200 warmup, 2000 steps.
preset=cpu is a first run of a couple of minutes on a CPU: the tiny Palimpsa-D (float32) on
the repository's own documentation (docs/*.md, README.md held out), context 128, batch 8,
300 steps (docs/training.md, "A first LM run on a CPU").
170m, 760m and 2.7b scan their layers (scan_layers); tiny unrolls them. Remat (remat,
remat_saves) is chosen per model and size from the step's estimated memory: none where the
device_batch x seq_len step fits STEP_BUDGET_GIB without it, else the policy that
recomputes least and fits (docs/activation_memory.md).
Unless `total_steps` is given, it is ceil(tokens / (batch_size * seq_len)), so changing
batch_size or seq_len keeps the token budget. The global batch is accumulated over as
many microbatches as keep each device at `device_batch` sequences or fewer
(config.grad_accum_steps=None; set it to fix the count). Any argument given explicitly
overrides the size's default. The tokenizer defaults to a byte-level BPE with
the model's vocabulary size, trained on the training files ("bpe:<vocab>").
An argument that sets a run-config field has that field's name
(palimpsa_jax/run_config/config_args.py); preset, model, size, tokens and warmup_steps (the
paper's warmup in steps, which sets config.optimizer.warmup_fraction) have none.
"""

import math

import ml_collections
from ml_collections import config_dict

from palimpsa_jax import models
from palimpsa_jax.models import activation_memory
from palimpsa_jax.models import config as model_fields
from palimpsa_jax.models import registry
from palimpsa_jax.run_config import base
from palimpsa_jax.run_config import config_args
from palimpsa_jax.run_config import values

DEFAULTS = dict(
    preset="",  # "cpu": PRESETS["cpu"] under the explicitly given arguments.
    model=registry.DEFAULT,
    size="170m",
    seq_len=4096,
    batch_size=128,
    tokens=15e9,  # Training tokens; sets steps unless steps is given.
    total_steps=config_dict.placeholder(int),  # None: ceil(tokens / (batch_size * seq_len)).
    learning_rate=3e-3,
    warmup_steps=2000,
    seed=0,
    dtype="bfloat16",
    device_batch=8,  # Most sequences per device and microbatch (gradient accumulation).
    scan_layers=False,  # One scanned block for all layers (fast compile, docs/training.md).
    remat=False,  # Recompute each block's activations in the backward pass.
    remat_saves="nothing",  # What a rematerialised block keeps (model.remat_saves).
    precision="exact",  # "rank1": Fast Palimpsa in palimpsa_d, meta_mamba2 (docs/fast_palimpsa.md).
)

# docs/models.md, sizes and recipe (170m, 760m); 2.7b and tiny are ours. Explicit arguments win.
# From 170m up the layers are one scanned block: it compiles in seconds instead of minutes
# (docs/training.md, "Scanned layers"). tiny (CPU smoke tests) stays unrolled.
SIZE_DEFAULTS = {
    "tiny": dict(seq_len=512, batch_size=16, tokens=2000 * 16 * 512, learning_rate=3e-3,
                 warmup_steps=200, device_batch=16),
    "170m": dict(tokens=15e9, learning_rate=3e-3, device_batch=8, scan_layers=True),
    "760m": dict(tokens=30e9, learning_rate=1.25e-3, device_batch=8, scan_layers=True),
    "2.7b": dict(tokens=30e9, learning_rate=8e-4, device_batch=4, scan_layers=True),
}
# The memory a compiled train step may take on one device: JAX's default share (75%) of an
# 80 GB GPU (79.1 GiB usable: 59.3 GiB), less room for what lives beside the step (the
# input batch, allocator fragmentation). Remat follows from it per model and size
# (models/activation_memory.py: the fastest remat_saves policy whose estimated step fits
# device_batch x seq_len tokens; docs/activation_memory.md); tiny runs without.
STEP_BUDGET_GIB = 58.0


PRESETS = {
    "cpu": dict(size="tiny", seq_len=128, batch_size=8, total_steps=300, warmup_steps=30,
                dtype="float32"),
}
# preset=cpu's data: files that ship with the repository (run from its root).
CPU_TRAIN_FILES, CPU_EVAL_FILES = "docs/*.md", "README.md"


# What each argument accepts: the run-config or model-config field it sets, else its own.
ARGUMENT_FIELDS = {
    **model_fields.FIELDS, **base.argument_fields("lm"),
    "preset": values.one_of("", ("", *PRESETS)),
    "size": values.one_of("170m", tuple(SIZE_DEFAULTS)),
    "tokens": values.positive(kind=float),
    "total_steps": values.or_none(values.positive(), "ceil(tokens / (batch_size * seq_len))"),
    "warmup_steps": values.at_least(0),
}


def parse_args(arg: str | None) -> ml_collections.ConfigDict:
  """Arguments with the preset's and then the size's defaults under the explicitly given ones."""
  args = config_args.parse_config_arg(arg, config_args.RENAMED_LM, fields=ARGUMENT_FIELDS,
                                      **DEFAULTS)
  given = config_args.given_keys(arg)
  for key, value in PRESETS.get(args.preset, {}).items():
    if key not in given:
      args[key] = value
      given.add(key)
  for key, value in SIZE_DEFAULTS[args.size].items():
    if key not in given:
      args[key] = value
  if args.size != "tiny" and not {"remat", "remat_saves"} <= given:
    remat, saves = activation_memory.sized_remat_choice(
        args.model, args.size, args.precision, args.dtype, args.device_batch, args.seq_len,
        STEP_BUDGET_GIB)
    if "remat" not in given:
      args.remat = remat
    if "remat_saves" not in given:
      args.remat_saves = saves
  if args.total_steps is None:
    args.total_steps = math.ceil(args.tokens / (args.batch_size * args.seq_len))
  return args


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The LM run: palimpsa_jax/run_config/base.py's fields, set from the arguments."""
  args = parse_args(arg)
  config = base.base_config("lm")
  config.args = args
  config.model = models.model_config(args.model, args.size, dtype=args.dtype,
                                     precision=args.precision)
  config.model.scan_layers = args.scan_layers
  config.model.remat = args.remat
  config.model.remat_saves = args.remat_saves
  config.seed = args.seed
  config.seq_len = args.seq_len
  config.batch_size = args.batch_size  # Global, in sequences.
  config.eval_batch_size = args.device_batch  # Global; its logits are [B, T, vocab] f32.
  # None: as many microbatches as keep each device at device_batch sequences or fewer.
  config.grad_accum_steps = None
  config.device_batch = args.device_batch
  config.total_steps = args.total_steps

  # config.data.train_files is required: glob(s) of text files or of .npy token shards.
  config.data.tokenizer = f"bpe:{config.model.vocab_size}"

  config.optimizer.learning_rate = args.learning_rate
  # The paper's warmup steps as a share of the run, which follows its actual length.
  config.optimizer.warmup_fraction = min(1.0, args.warmup_steps / args.total_steps)
  config.optimizer.end_fraction = 0.1
  config.optimizer.b2 = 0.95
  config.optimizer.eps = 1e-15

  if args.preset == "cpu":
    config.data.train_files, config.data.eval_files = CPU_TRAIN_FILES, CPU_EVAL_FILES
    config.data.eval_batches = 4
    config.log_every_steps = 25
    config.eval_every_steps = config.checkpoint_every_steps = 100

  config.mesh.data = 1
  config.mesh.fsdp = -1
  return config

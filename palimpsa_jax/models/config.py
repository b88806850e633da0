"""Model configs: paper sizes and MQAR settings (docs/models.md).

A model config is a flat ml_collections.ConfigDict. Shared fields:
  model, mixer ("palimpsa_d" | "meta_mamba2" | "gated_deltanet" | "mesanet" |
  "attention"),
  metaplasticity, metaplastic_layers, vocab_size, d_model, num_layers, mlp_hidden_dim (0: no MLP),
  norm_eps, init_std, dtype (compute dtype name), residual_in_fp32, remat,
  remat_saves (what a rematerialised block keeps: "nothing", "matmuls", "matmuls_and_readouts"
  or "matmuls_readouts_and_states"; see LanguageModel), scan_layers (one stacked, scanned block;
  see LanguageModel), implementation, chunk_size, matmul_precision, head_loss (the
  training loss's implementation, models.head_loss: "xla" or "pallas_gpu").
Mixer fields:
  palimpsa_d / gated_deltanet: num_heads, head_k_dim, head_v_dim, conv_kernel,
    A_init, A_init_range, dt_min, dt_max, dt_init_floor (+ beta_rank for
    palimpsa_d);
  mesanet: the gated_deltanet fields and cg_steps (conjugate-gradient steps of
    the readout over whole sequences);
  meta_mamba2: expand, head_dim, state_dim, num_groups, beta_rank, conv_kernel,
    A_init, A_init_range, dt_min, dt_max, dt_init_floor, norm_groups (groups
    of the output RMSNorm; 0: num_groups);
  attention: num_heads, head_dim, rope, rope_theta, attention_implementation
    (None / "xla" / "cudnn", see jax.nn.dot_product_attention).
  palimpsa_d and meta_mamba2 also: beta_bias (whether the beta up-projection has a
    bias; False by default, as in the authors' PyTorch models; MQAR models keep the
    bias their published results were measured with; a saved config without the field
    is from before it existed and had the bias) and precision ("exact", the default: the
    Palimpsa op; "rank1": Fast Palimpsa, a rank-1 precision inside chunks of chunk_size,
    docs/fast_palimpsa.md).
metaplastic_layers: indices of layers whose mixer is metaplastic in addition to
  what config.metaplasticity says for every layer (a converted Mamba2 /
  NotPalimpsa model, docs/models.md, conversion); () (the default): none beyond it. Only
  for the palimpsa_d and meta_mamba2 mixers.
"""

import ml_collections

from palimpsa_jax.layers.mlp import swiglu_hidden_dim

MODELS = ("palimpsa_d", "not_palimpsa", "meta_mamba2", "mamba2",
          "gated_deltanet", "mesanet", "transformer")
SIZES = ("tiny", "170m", "760m", "2.7b")
# Nominal parameter count of each size name (tiny has none).
NOMINAL_PARAMS = {"170m": 170e6, "760m": 760e6, "2.7b": 2.7e9}

_MIXER = {
    "palimpsa_d": ("palimpsa_d", True),
    "not_palimpsa": ("palimpsa_d", False),
    "meta_mamba2": ("meta_mamba2", True),
    "mamba2": ("meta_mamba2", False),
    "gated_deltanet": ("gated_deltanet", False),
    "mesanet": ("mesanet", False),
    "transformer": ("attention", False),
}

# MesaNet's conjugate-gradient steps per readout (the published training value).
MESANET_CG_STEPS = 30

# Palimpsa-D / NotPalimpsa, and Gated DeltaNet / MesaNet with the same head layout. Sizes
# without mlp_hidden_dim take swiglu_hidden_dim(d_model) (2048, 4096, 6912);
# tiny's 128 is smaller than that rule.
_DELTA_SIZES = {
    "tiny": dict(num_layers=2, d_model=64, num_heads=4, head_k_dim=16,
                 head_v_dim=16, beta_rank=4, vocab_size=512,
                 mlp_hidden_dim=128),
    "170m": dict(num_layers=19, d_model=768, num_heads=16, head_k_dim=48,
                 head_v_dim=48, beta_rank=48, vocab_size=32000),
    "760m": dict(num_layers=19, d_model=1536, num_heads=16, head_k_dim=96,
                 head_v_dim=192, beta_rank=96, vocab_size=32000),
    "2.7b": dict(num_layers=25, d_model=2560, num_heads=20, head_k_dim=128,
                 head_v_dim=256, beta_rank=160, vocab_size=32000),
}
# MetaMamba2 / Mamba2 (expand 2, no MLP); 2.7b is the Mamba2-2.7B backbone.
_MAMBA_SIZES = {
    "tiny": dict(num_layers=2, d_model=64, expand=2, head_dim=32,
                 state_dim=16, num_groups=2, beta_rank=4, vocab_size=512),
    "170m": dict(num_layers=30, d_model=768, expand=2, head_dim=96,
                 state_dim=48, num_groups=16, beta_rank=48, vocab_size=32000),
    "760m": dict(num_layers=38, d_model=1536, expand=2, head_dim=192,
                 state_dim=96, num_groups=16, beta_rank=96, vocab_size=32000),
    "2.7b": dict(num_layers=64, d_model=2560, expand=2, head_dim=64,
                 state_dim=128, num_groups=1, beta_rank=160,
                 vocab_size=50288),
}
# Transformer++: layers chosen to match Palimpsa-D's parameter count.
_ATTENTION_SIZES = {
    "tiny": dict(num_layers=2, d_model=64, num_heads=4, head_dim=16,
                 vocab_size=512, mlp_hidden_dim=128),
    "170m": dict(num_layers=21, d_model=768, num_heads=12, head_dim=64,
                 vocab_size=32000),
    "760m": dict(num_layers=26, d_model=1536, num_heads=16, head_dim=96,
                 vocab_size=32000),
    "2.7b": dict(num_layers=34, d_model=2560, num_heads=20, head_dim=128,
                 vocab_size=32000),
}


def _common(model: str) -> dict:
  mixer, metaplasticity = _MIXER[model]
  return dict(model=model, mixer=mixer, metaplasticity=metaplasticity,
              metaplastic_layers=(),
              norm_eps=1e-5 if mixer == "meta_mamba2" else 1e-6,
              init_std=0.02, dtype="bfloat16", residual_in_fp32=True,
              remat=False, remat_saves="nothing", scan_layers=False, implementation="auto",
              chunk_size=64, matmul_precision="default", head_loss="xla", precision="exact")


def _gates(mixer: str) -> dict:
  if mixer == "meta_mamba2":
    a_init = dict(A_init="arange", A_init_range=(1.0, 16.0))
  else:
    a_init = dict(A_init="uniform", A_init_range=(0.0, 16.0))
  return dict(conv_kernel=4, dt_min=1e-3, dt_max=1e-1, dt_init_floor=1e-4,
              **a_init)


def _apply_overrides(config: ml_collections.ConfigDict,
                     overrides: dict) -> ml_collections.ConfigDict:
  for key, value in overrides.items():
    if key not in config:
      raise ValueError(
          f"unknown model config field {key!r}; fields: {sorted(config)}")
    config[key] = value
  return config


def _check_model(model: str) -> None:
  if model not in MODELS:
    raise ValueError(f"model must be one of {MODELS}, got {model!r}")


def model_config(model: str, size: str, **overrides) -> ml_collections.ConfigDict:
  """Config of `model` at `size` (docs/models.md, sizes and recipe), with field overrides."""
  _check_model(model)
  if size not in SIZES:
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")
  fields = _common(model)
  mixer = fields["mixer"]
  if mixer == "meta_mamba2":
    fields.update(_MAMBA_SIZES[size], mlp_hidden_dim=0, **_gates(mixer))
  elif mixer == "attention":
    fields.update(_ATTENTION_SIZES[size], rope=True, rope_theta=10000.0,
                  attention_implementation=None)
  else:
    fields.update(_DELTA_SIZES[size], **_gates(mixer))
    if mixer in ("gated_deltanet", "mesanet"):
      del fields["beta_rank"]
    if mixer == "mesanet":
      fields["cg_steps"] = MESANET_CG_STEPS
  if mixer in ("palimpsa_d", "meta_mamba2"):
    fields["beta_bias"] = False  # the authors' b_proj has none, so the model exports
  if mixer == "meta_mamba2":
    fields["norm_groups"] = 0
  fields.setdefault("mlp_hidden_dim", swiglu_hidden_dim(fields["d_model"]))
  fields["size"] = size
  return _apply_overrides(ml_collections.ConfigDict(fields), overrides)


def mqar_model_config(mixer: str, d_model: int = 128, vocab_size: int = 8192,
                      **overrides) -> ml_collections.ConfigDict:
  """MQAR model (docs/models.md, MQAR): 2 layers, no MLP, no positional embeddings.

  mixer is a model name (palimpsa_d, not_palimpsa, meta_mamba2, mamba2,
  gated_deltanet, mesanet, transformer). Forget gates start "small": A spread evenly
  over [0.01, 0.16] across heads, dt log-uniform over [1e-3, 1e-1].
  """
  _check_model(mixer)
  fields = _common(mixer)
  kind = fields["mixer"]
  fields.update(vocab_size=vocab_size, d_model=d_model, num_layers=2,
                mlp_hidden_dim=0, size="mqar")
  if kind == "attention":
    fields.update(num_heads=8, head_dim=d_model // 8, rope=False,
                  rope_theta=10000.0, attention_implementation=None)
  else:
    fields.update(_gates(kind))
    fields.update(A_init="linspace", A_init_range=(0.01, 0.16))
    if kind in ("palimpsa_d", "meta_mamba2"):
      fields.update(beta_bias=True)  # as in the MQAR results (docs/results/)
    if kind == "meta_mamba2":
      fields.update(expand=2, head_dim=32, state_dim=16, num_groups=8,
                    beta_rank=8)
      if (2 * d_model) % 32:
        raise ValueError(f"d_model must be a multiple of 16, got {d_model}")
    else:
      fields.update(num_heads=8, head_k_dim=16, head_v_dim=32)
      if kind == "palimpsa_d":
        fields.update(beta_rank=8)
      if kind == "mesanet":
        fields.update(cg_steps=MESANET_CG_STEPS)
  return _apply_overrides(ml_collections.ConfigDict(fields), overrides)

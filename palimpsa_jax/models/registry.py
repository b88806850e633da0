"""The mixer registry: every mixer the models can be built with, declared once.

A mixer name (config `model=`, e.g. "mamba2") is a MIXERS entry: its kind and whether it is
metaplastic. A kind (config.model.mixer, e.g. "meta_mamba2") is a KINDS entry: its layer
class, its own model-config fields (each one the layer argument of that name), the model-wide
fields the layer also takes, its sizes and its MQAR layout. models/config.py builds model
configs from these tables, make_mixer builds the layers, and configs/mqar.py, configs/lm.py
and the benchmarks read the names, labels and defaults from here: no other product file
spells a mixer's name (tests/test_mixer_names.py), except the conversions, which map outside
formats' names to ours. A new mixer is a layer module under palimpsa_jax/layers/ (with its
tests) and an entry here: a MIXERS entry, and a KINDS entry when its layer is new.
"""

from collections.abc import Callable
import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import ml_collections
from flax import nnx

from palimpsa_jax.layers import Attention, GatedDeltaNet, MesaNet, MetaMamba2, PalimpsaD
from palimpsa_jax.run_config.values import Field, flag, one_of, positive

# MesaNet's conjugate-gradient steps per readout (the published training value).
MESANET_CG_STEPS = 30


@dataclasses.dataclass(frozen=True)
class Kind:
  """One layer family.

  Attributes:
    layer: the layer class, called as layer(d_model, **arguments, rngs=, init_std=, dtype=).
    fields: its own model-config fields, each passed as the layer argument of its name
      (`renamed` says where the argument's name differs); defaults are the language models'.
    model_fields: model-wide config fields the layer also takes, under their own names.
    sizes: size name (models/config.py SIZES) -> fields of that size (layers, width,
      vocabulary and its own fields).
    mqar: d_model -> its fields in the MQAR model (docs/models.md, MQAR).
    metaplastic: whether it has metaplasticity (beta parameters, metaplastic_layers) and the
      precision choice of the Palimpsa op.
    mlp: whether its language-model blocks have a SwiGLU MLP (Mamba2 blocks have none).
    norm_eps: its RMSNorms' epsilon.
    renamed: layer argument -> the config field that holds it, where the names differ.
  """
  layer: type[nnx.Module]
  fields: dict[str, Field]
  model_fields: tuple[str, ...]
  sizes: dict[str, dict[str, Any]]
  mqar: Callable[[int], dict[str, Any]]
  metaplastic: bool = False
  mlp: bool = True
  norm_eps: float = 1e-6
  renamed: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Mixer:
  """One mixer name.

  Attributes:
    kind: its KINDS entry.
    metaplasticity: config.metaplasticity (every layer metaplastic) of its models.
    label: its name in tables and plots.
    color: its matplotlib colour in plots.
    paper_mqar: whether the paper's MQAR comparison trains it (benchmarks/mqar/sweep.py).
    throughput: whether benchmarks/step/throughput.py times it by default.
  """
  kind: str
  metaplasticity: bool
  label: str
  color: str
  paper_mqar: bool
  throughput: bool = False


def _gates(a_init: str, a_range: tuple[float, float]) -> dict[str, Field]:
  """The recurrent layers' short convolution and forget-gate initialisation fields."""
  return {
      "conv_kernel": positive(4),
      "A_init": one_of(a_init, ("uniform", "arange", "linspace")),
      "A_init_range": Field(a_range, (tuple, list),
                            lambda v: len(v) == 2 and 0 <= v[0] <= v[1],
                            "(low, high) with 0 <= low <= high"),
      "dt_min": positive(1e-3, float),
      "dt_max": positive(1e-1, float),
      "dt_init_floor": positive(1e-4, float),
  }


_HEADS = {"num_heads": positive(), "head_k_dim": positive(), "head_v_dim": positive()}
# The beta up-projection's bias: the authors' PyTorch models have none; the MQAR models keep
# the one their published results were measured with (docs/results/).
_BETA = {"beta_rank": positive(), "beta_bias": flag(False)}
_RECURRENT = ("norm_eps", "implementation", "chunk_size")
_METAPLASTIC = _RECURRENT + ("precision",)
# Forget gates start "small" on MQAR: A spread evenly over [0.01, 0.16] across heads.
_MQAR_GATES = dict(A_init="linspace", A_init_range=(0.01, 0.16))


def _without(sizes: dict[str, dict], name: str) -> dict[str, dict]:
  return {size: {k: v for k, v in fields.items() if k != name} for size, fields in sizes.items()}


# Palimpsa-D / NotPalimpsa, and Gated DeltaNet / MesaNet with the same head layout. Sizes
# without mlp_hidden_dim take swiglu_hidden_dim(d_model) (2048, 4096, 6912);
# tiny's 128 is smaller than that rule.
_DELTA_SIZES = {
    "tiny": dict(num_layers=2, d_model=64, num_heads=4, head_k_dim=16,
                 head_v_dim=16, beta_rank=4, vocab_size=512, mlp_hidden_dim=128),
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
                 state_dim=128, num_groups=1, beta_rank=160, vocab_size=50288),
}
# Transformer++: layers chosen to match Palimpsa-D's parameter count.
_ATTENTION_SIZES = {
    "tiny": dict(num_layers=2, d_model=64, num_heads=4, head_dim=16,
                 vocab_size=512, mlp_hidden_dim=128),
    "170m": dict(num_layers=21, d_model=768, num_heads=12, head_dim=64, vocab_size=32000),
    "760m": dict(num_layers=26, d_model=1536, num_heads=16, head_dim=96, vocab_size=32000),
    "2.7b": dict(num_layers=34, d_model=2560, num_heads=20, head_dim=128, vocab_size=32000),
}


def _mqar_delta(beta: bool) -> Callable[[int], dict[str, Any]]:
  """8 heads of K=16, V=32 (+ beta rank 8)."""
  def fields(d_model: int) -> dict[str, Any]:
    del d_model
    extra = dict(beta_rank=8, beta_bias=True) if beta else {}
    return dict(num_heads=8, head_k_dim=16, head_v_dim=32, **_MQAR_GATES, **extra)
  return fields


def _mqar_mamba(d_model: int) -> dict[str, Any]:
  """2 * d_model / 32 heads of P=32, N=16; the B/C groups (at most 8) divide the heads."""
  if (2 * d_model) % 32:
    raise ValueError(f"d_model must be a multiple of 16, got {d_model}")
  return dict(expand=2, head_dim=32, state_dim=16, num_groups=math.gcd(8, 2 * d_model // 32),
              beta_rank=8, beta_bias=True, **_MQAR_GATES)


def _mqar_attention(d_model: int) -> dict[str, Any]:
  """8 heads, no positional embeddings."""
  return dict(num_heads=8, head_dim=d_model // 8, rope=False)


KINDS = {
    "palimpsa_d": Kind(
        PalimpsaD, {**_HEADS, **_BETA, **_gates("uniform", (0.0, 16.0))}, _METAPLASTIC,
        _DELTA_SIZES, _mqar_delta(beta=True), metaplastic=True),
    "meta_mamba2": Kind(
        MetaMamba2,
        {"expand": positive(), "head_dim": positive(), "state_dim": positive(),
         "num_groups": positive(), **_BETA,
         # Groups of the output RMSNorm; None: num_groups.
         "norm_groups": Field(None, (int, type(None)), lambda v: v is None or v > 0,
                              "a positive int, or None (num_groups)"),
         **_gates("arange", (1.0, 16.0))},
        _METAPLASTIC, _MAMBA_SIZES, _mqar_mamba, metaplastic=True, mlp=False, norm_eps=1e-5),
    "gated_deltanet": Kind(
        GatedDeltaNet, {**_HEADS, **_gates("uniform", (0.0, 16.0))}, _RECURRENT,
        _without(_DELTA_SIZES, "beta_rank"), _mqar_delta(beta=False)),
    "mesanet": Kind(
        MesaNet,
        {**_HEADS, **_gates("uniform", (0.0, 16.0)),
         # Conjugate-gradient steps of the readout over whole sequences.
         "cg_steps": positive(MESANET_CG_STEPS)},
        _RECURRENT, _without(_DELTA_SIZES, "beta_rank"), _mqar_delta(beta=False)),
    "attention": Kind(
        Attention,
        {"num_heads": positive(), "head_dim": positive(), "rope": flag(True),
         "rope_theta": positive(10000.0, float),
         # jax.nn.dot_product_attention's implementation; None: XLA's choice.
         "attention_implementation": one_of(None, (None, "xla", "cudnn"))},
        (), _ATTENTION_SIZES, _mqar_attention,
        renamed={"implementation": "attention_implementation"}),
}

MIXERS = {
    "palimpsa_d": Mixer("palimpsa_d", metaplasticity=True, label="Palimpsa-D", color="C0",
                        paper_mqar=True, throughput=True),
    "not_palimpsa": Mixer("palimpsa_d", metaplasticity=False, label="NotPalimpsa", color="C1",
                          paper_mqar=True, throughput=True),
    "meta_mamba2": Mixer("meta_mamba2", metaplasticity=True, label="MetaMamba2", color="C2",
                         paper_mqar=True),
    "mamba2": Mixer("meta_mamba2", metaplasticity=False, label="Mamba2", color="C3",
                    paper_mqar=True, throughput=True),
    "gated_deltanet": Mixer("gated_deltanet", metaplasticity=False, label="Gated DeltaNet",
                            color="C4", paper_mqar=True, throughput=True),
    "mesanet": Mixer("mesanet", metaplasticity=False, label="MesaNet", color="C5",
                     paper_mqar=False),
    "transformer": Mixer("attention", metaplasticity=False, label="Transformer++", color="C6",
                         paper_mqar=False),
}
# The project's own mixer: the configs' default model, and the benchmarks' where they time one.
DEFAULT = "palimpsa_d"
# Throughput ratios are step times over this mixer's (benchmarks/step/throughput.py).
BASELINE = "mamba2"
# The softmax-attention baseline (benchmarks/step/decode.py compares decoding with it).
ATTENTION = "transformer"
# The mixers of the paper's MQAR comparison, in MIXERS' order.
PAPER_MQAR = tuple(name for name, mixer in MIXERS.items() if mixer.paper_mqar)
# The mixers benchmarks/step/throughput.py times by default, in MIXERS' order.
THROUGHPUT = tuple(name for name, mixer in MIXERS.items() if mixer.throughput)
# The kinds with metaplasticity (the Palimpsa op's mixers).
METAPLASTIC_KINDS = tuple(name for name, family in KINDS.items() if family.metaplastic)


def label(name: str) -> str:
  """How tables and plots name a mixer; an unknown name (an older run's) as it is."""
  return MIXERS[name].label if name in MIXERS else name


def mixer(name: str) -> Mixer:
  """The MIXERS entry of `name`; ValueError naming the known ones otherwise."""
  if name not in MIXERS:
    raise ValueError(f"model must be one of {tuple(MIXERS)}, got {name!r}")
  return MIXERS[name]


def kind(config: ml_collections.ConfigDict) -> Kind:
  """The KINDS entry of config.mixer; ValueError naming the known ones otherwise."""
  if config.mixer not in KINDS:
    raise ValueError(f"config.mixer must be one of {tuple(KINDS)}, got {config.mixer!r}")
  return KINDS[config.mixer]


def make_mixer(config: ml_collections.ConfigDict, rngs: nnx.Rngs,
               metaplasticity: bool | None = None) -> nnx.Module:
  """The layer of config.mixer's kind, built from the config's fields.

  metaplasticity (metaplastic kinds only) overrides config.metaplasticity, e.g. for one
  layer of a converted model.
  """
  family = kind(config)
  if config.precision != "exact" and not family.metaplastic:
    raise ValueError(
        f"precision={config.precision!r} needs a Palimpsa mixer "
        f"({', '.join(METAPLASTIC_KINDS)}); config.mixer is "
        f"{config.mixer!r}, whose only precision is 'exact'")
  arguments = {name: config[name] for name in family.model_fields}
  for name in family.fields:
    value = config[name]
    arguments[name] = tuple(value) if isinstance(value, list) else value  # JSON's lists
  for argument, name in family.renamed.items():
    arguments[argument] = arguments.pop(name)
  if family.metaplastic:
    arguments["metaplasticity"] = (config.metaplasticity if metaplasticity is None
                                   else metaplasticity)
  return family.layer(config.d_model, rngs=rngs, init_std=config.init_std,
                      dtype=jnp.dtype(config.dtype), **arguments)

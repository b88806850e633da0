"""The authors' PyTorch models: their config.json settings and tensor names, against ours.

Two Hugging Face model types (config.json "model_type"), N the layer index:

palimpsa (PalimpsaForCausalLM: Palimpsa-D; NotPalimpsa with metaplasticity false)
  model.embeddings.weight                      [V, d]       embed
  model.layers.N.attn_norm.weight              [d]          blocks/N/mixer_norm/scale
  model.layers.N.attn.{q,k}_proj.weight        [H K, d]     mixer/{q,k}_proj/kernel
  model.layers.N.attn.v_proj.weight            [H Vh, d]    mixer/v_proj/kernel
  model.layers.N.attn.{q,k,v}_conv1d.weight    [C, 1, W]    mixer/{q,k,v}_conv/kernel [W, C]
  model.layers.N.attn.dt_proj.weight           [H, d]       mixer/dt_proj/kernel
  model.layers.N.attn.bs_proj.weight           [H, d]       mixer/s_proj/kernel
  model.layers.N.attn.{A_log, dt_bias, D}      [H]          mixer/{A_log, dt_bias, D}
  model.layers.N.attn.b_rank_proj.weight       [r, d]       mixer/beta_down/kernel
  model.layers.N.attn.b_proj.weight            [H Vh, r]    mixer/beta_up/kernel
  model.layers.N.attn.{b_scale, Ip_log}        [H]          mixer/{b_scale, Ip_log}
  model.layers.N.attn.g_proj.weight            [H Vh, d]    mixer/gate_proj/kernel
  model.layers.N.attn.o_norm.weight            [Vh]         mixer/out_norm/scale
  model.layers.N.attn.o_proj.weight            [d, H Vh]    mixer/out_proj/kernel
  model.layers.N.mlp_norm.weight               [d]          blocks/N/mlp_norm/scale
  model.layers.N.mlp.{gate,up}_proj.weight     [F, d]       mlp/{gate,up}_proj/kernel
  model.layers.N.mlp.down_proj.weight          [d, F]       mlp/down_proj/kernel
  model.norm.weight                            [d]          final_norm/scale
meta_mamba2 (MetaMamba2ForCausalLM: Palimpsa-M; Mamba2 with metaplasticity false)
  backbone.embeddings.weight                   [V, d]       embed
  backbone.layers.N.norm.weight                [d]          blocks/N/mixer_norm/scale
  backbone.layers.N.mixer.in_proj.weight       [2 Di + 2 G Ns + H, d]   mixer/in_proj/kernel
  backbone.layers.N.mixer.conv1d.{weight,bias} [Di + 2 G Ns, 1, W], [..] mixer/conv/{kernel,bias}
  backbone.layers.N.mixer.{A_log, dt_bias, D}  [H]          mixer/{A_log, dt_bias, D}
  backbone.layers.N.mixer.b_rank_proj.weight   [r, d]       mixer/beta_down/kernel
  backbone.layers.N.mixer.b_proj.weight        [Di, r]      mixer/beta_up/kernel
  backbone.layers.N.mixer.{b_scale, Ip_log}    [H]          mixer/{b_scale, Ip_log}
  backbone.layers.N.mixer.norm.weight          [Di]         mixer/norm/scale
  backbone.layers.N.mixer.out_proj.weight      [d, Di]      mixer/out_proj/kernel
  backbone.norm_f.weight                       [d]          final_norm/scale
and lm_head.weight [V, d], which must equal the embedding (both sides tie them).
Torch Linear weights are [out, in], ours [in, out]. The parametrisations are the
same on both sides: A = exp(A_log), dt = softplus(. + dt_bias), beta scale
softplus(b_scale), prior precision exp(Ip_log). The authors' non-metaplastic
layers still hold the four beta tensors, unused: an import checks and drops
them, an export writes zeros (b_scale: ones).
"""

import dataclasses
import math
from typing import Any

import ml_collections

from palimpsa_jax import models
from palimpsa_jax.layers.mlp import swiglu_hidden_dim

MODEL_TYPES = ("palimpsa", "meta_mamba2")
ARCHITECTURES = {"palimpsa": "PalimpsaForCausalLM", "meta_mamba2": "MetaMamba2ForCausalLM"}
PREFIXES = {"palimpsa": "model", "meta_mamba2": "backbone"}
LM_HEAD = "lm_head.weight"

# The authors' config-class defaults: what from_pretrained uses for an absent key.
_DEFAULTS = {
    "palimpsa": dict(
        hidden_size=2048, expand_v=2.0, expand_k=1, use_gate=True, beta_step_rank="auto",
        use_short_conv=True, conv_size=4, head_dim=256, num_heads=6, num_v_heads=None,
        hidden_ratio=4, intermediate_size=None, hidden_act="swish", num_hidden_layers=21,
        norm_eps=1e-6, attn=None, tie_word_embeddings=False, vocab_size=32000,
        use_residual=True, metaplasticity=True),
    "meta_mamba2": dict(
        head_dim=64, vocab_size=32000, hidden_size=2048, state_size=128,
        num_hidden_layers=48, norm_eps=1e-5, expand=2, conv_kernel=4, n_groups=1,
        use_bias=False, use_conv_bias=True, hidden_act="silu", metaplasticity=True,
        beta_step_rank="auto", time_step_limit=(0.0, math.inf),
        tie_word_embeddings=False, residual_in_fp32=True),
}
_OUR_MODELS = {("palimpsa", True): "palimpsa_d", ("palimpsa", False): "not_palimpsa",
               ("meta_mamba2", True): "meta_mamba2", ("meta_mamba2", False): "mamba2"}
_MODEL_TYPE_OF_MIXER = {"palimpsa_d": "palimpsa", "meta_mamba2": "meta_mamba2"}


def our_mixer(model_type: str, metaplasticity: bool) -> str:
  """Our mixer name (models/registry.py) for the authors' model_type with or without
  metaplasticity."""
  return _OUR_MODELS[model_type, metaplasticity]


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One tensor of the authors' checkpoint.

  Attributes:
    name: its name in the safetensors file.
    shape: its (torch) shape.
    path: our parameter path, or None for a tensor the model does not use (read
      and checked, then dropped; written as `fill` on export).
    kind: "linear" ([out, in] vs our [in, out]), "conv" ([C, 1, W] vs our
      [W, C]) or "same".
    fill: export value of an unused tensor.
  """
  name: str
  shape: tuple[int, ...]
  path: tuple[Any, ...] | None
  kind: str = "same"
  fill: float = 0.0


def _setting(hf_config: dict[str, Any], model_type: str, key: str) -> Any:
  return hf_config.get(key, _DEFAULTS[model_type][key])


def _json_float(value: Any) -> float:
  """A float of config.json; transformers 5 writes infinity as {"__float__": "Infinity"}."""
  return float(value["__float__"]) if isinstance(value, dict) else float(value)


def model_type_of(hf_config: dict[str, Any], source: str) -> str:
  """config.json's model_type, one of MODEL_TYPES; ValueError otherwise."""
  model_type = hf_config.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(
        f"{source}: config.json model_type {model_type!r} is not one of the authors' "
        f"models this converter reads: {MODEL_TYPES}")
  return model_type


def _beta_rank(hf_config: dict[str, Any], model_type: str) -> int:
  rank = _setting(hf_config, model_type, "beta_step_rank")
  if rank == "auto":  # their configs' rule
    return math.ceil(_setting(hf_config, model_type, "hidden_size") / 16)
  return int(rank)


def _unsupported(model_type: str, problems: list[str]) -> None:
  if problems:
    raise ValueError(
        f"the authors' {model_type} model uses options this project's model lacks, so it "
        "cannot be imported exactly: " + "; ".join(problems))


def _palimpsa_config(hf: dict[str, Any], dtype: str) -> ml_collections.ConfigDict:
  get = lambda key: _setting(hf, "palimpsa", key)
  num_heads = int(get("num_heads"))
  problems = []
  if get("attn") is not None:
    problems.append(f"hybrid attention layers (attn={get('attn')})")
  if not get("use_gate"):
    problems.append("use_gate=false (an ungated output norm)")
  if not get("use_short_conv"):
    problems.append("use_short_conv=false (no q/k/v short convolutions)")
  if get("num_v_heads") not in (None, num_heads):
    problems.append(f"num_v_heads={get('num_v_heads')} != num_heads={num_heads}")
  if not get("use_residual"):
    problems.append("use_residual=false (no D * v term)")
  if get("hidden_act") not in ("swish", "silu"):
    problems.append(f"hidden_act={get('hidden_act')!r} (the MLP is SwiGLU)")
  _unsupported("palimpsa", problems)
  d = int(get("hidden_size"))
  hidden = get("intermediate_size")
  if hidden is None:  # FLA's GatedMLP rule, the same as ours
    hidden = swiglu_hidden_dim(d, get("hidden_ratio") or 4)
  config = models.model_config(
      _OUR_MODELS["palimpsa", bool(get("metaplasticity"))], "tiny",
      vocab_size=int(get("vocab_size")), d_model=d, num_layers=int(get("num_hidden_layers")),
      num_heads=num_heads,
      head_k_dim=int(get("head_dim") * get("expand_k")),
      head_v_dim=int(get("head_dim") * get("expand_v")), beta_rank=_beta_rank(hf, "palimpsa"),
      mlp_hidden_dim=int(hidden), conv_kernel=int(get("conv_size")),
      norm_eps=float(get("norm_eps")), beta_bias=False, dtype=dtype)
  config.size = "authors"
  return config


def _meta_mamba2_config(hf: dict[str, Any], dtype: str) -> ml_collections.ConfigDict:
  get = lambda key: _setting(hf, "meta_mamba2", key)
  d, expand, head_dim = int(get("hidden_size")), get("expand"), int(get("head_dim"))
  problems = []
  if get("use_bias"):
    problems.append("use_bias=true (biases on in_proj and out_proj)")
  if not get("use_conv_bias"):
    problems.append("use_conv_bias=false (our xBC convolution always has a bias)")
  if get("hidden_act") not in ("silu", "swish"):
    problems.append(f"hidden_act={get('hidden_act')!r} (our convolution uses SiLU)")
  low, high = (_json_float(x) for x in get("time_step_limit"))
  if low != 0.0 or not math.isinf(high):
    problems.append(f"time_step_limit={list(get('time_step_limit'))} (only (0, inf))")
  if int(expand) != expand or (int(expand) * d) % head_dim:
    problems.append(f"expand={expand} with head_dim={head_dim}: inner width "
                    f"{expand * d} is not a whole number of heads")
  _unsupported("meta_mamba2", problems)
  config = models.model_config(
      _OUR_MODELS["meta_mamba2", bool(get("metaplasticity"))], "tiny",
      vocab_size=int(get("vocab_size")), d_model=d, num_layers=int(get("num_hidden_layers")),
      expand=int(expand), head_dim=head_dim, state_dim=int(get("state_size")),
      num_groups=int(get("n_groups")), beta_rank=_beta_rank(hf, "meta_mamba2"),
      conv_kernel=int(get("conv_kernel")), norm_eps=float(get("norm_eps")),
      residual_in_fp32=bool(get("residual_in_fp32")), beta_bias=False, norm_groups=1,
      dtype=dtype)
  config.size = "authors"
  return config


def our_config(hf_config: dict[str, Any], dtype: str = "float32",
               source: str = "source") -> ml_collections.ConfigDict:
  """Our model config for the authors' config.json (ValueError for what we cannot map)."""
  model_type = model_type_of(hf_config, source)
  if model_type == "palimpsa":
    return _palimpsa_config(hf_config, dtype)
  return _meta_mamba2_config(hf_config, dtype)


def authors_model_type(config: ml_collections.ConfigDict) -> str:
  """The authors' model_type for our model config; ValueError where none fits exactly."""
  model_type = _MODEL_TYPE_OF_MIXER.get(config.mixer)
  if model_type is None:
    raise ValueError(
        f"config.mixer={config.mixer!r} has no counterpart in the authors' models "
        f"(they have {sorted(_MODEL_TYPE_OF_MIXER)})")
  if config.get("precision", "exact") != "exact":
    raise ValueError(
        f"config.precision={config.precision!r} (Fast Palimpsa) has no counterpart in the "
        "authors' released models, whose layers run the exact op; export a precision='exact' "
        "model")
  metaplastic = models.metaplastic_layers(config)
  if metaplastic and len(metaplastic) != config.num_layers:
    raise ValueError(
        f"only layers {list(metaplastic)} of {config.num_layers} are metaplastic; the authors' "
        "models have one metaplasticity flag for every layer")
  if model_type == "palimpsa" and not config.mlp_hidden_dim:
    raise ValueError("config.mlp_hidden_dim=0: the authors' Palimpsa blocks always have an MLP")
  if model_type == "meta_mamba2" and config.get("mlp_hidden_dim"):
    raise ValueError("config.mlp_hidden_dim > 0: the authors' MetaMamba2 blocks have no MLP")
  if model_type == "meta_mamba2":
    groups = config.get("norm_groups") or config.num_groups
    if groups != 1:
      raise ValueError(
          f"the output RMSNorm normalises over {groups} groups (config.norm_groups); the "
          "authors' MetaMamba2 normalises the whole inner width at once (norm_groups=1)")
  return model_type


def authors_config(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The authors' config.json for our model config (see authors_model_type)."""
  model_type = authors_model_type(config)
  common = dict(
      architectures=[ARCHITECTURES[model_type]], model_type=model_type,
      hidden_size=config.d_model, num_hidden_layers=config.num_layers,
      vocab_size=config.vocab_size, norm_eps=config.norm_eps,
      beta_step_rank=config.beta_rank, tie_word_embeddings=True,
      metaplasticity=bool(models.metaplastic_layers(config)), init_diagnosis=False)
  if model_type == "meta_mamba2":
    return dict(
        common, head_dim=config.head_dim,
        num_heads=config.expand * config.d_model // config.head_dim,
        state_size=config.state_dim, expand=config.expand, n_groups=config.num_groups,
        conv_kernel=config.conv_kernel, use_bias=False, use_conv_bias=True,
        hidden_act="silu", residual_in_fp32=bool(config.residual_in_fp32))
  expand_v = config.head_v_dim / config.head_k_dim
  if int(config.head_k_dim * expand_v) != config.head_v_dim:
    raise ValueError(
        f"head_v_dim {config.head_v_dim} is not head_k_dim {config.head_k_dim} times a "
        "factor the authors' expand_v reproduces")
  return dict(
      common, num_heads=config.num_heads, head_dim=config.head_k_dim, expand_k=1,
      expand_v=int(expand_v) if expand_v.is_integer() else expand_v, use_gate=True,
      use_short_conv=True, conv_size=config.conv_kernel, hidden_ratio=4,
      intermediate_size=config.mlp_hidden_dim, hidden_act="swish", use_residual=True)


def _palimpsa_layer(config: ml_collections.ConfigDict, metaplastic: bool) -> list[Tensor]:
  d, h, kd, vd = config.d_model, config.num_heads, config.head_k_dim, config.head_v_dim
  r, f, w = config.beta_rank, config.mlp_hidden_dim, config.conv_kernel
  m = ("mixer",)
  mixer = [
      Tensor("attn.q_proj.weight", (h * kd, d), m + ("q_proj", "kernel"), "linear"),
      Tensor("attn.k_proj.weight", (h * kd, d), m + ("k_proj", "kernel"), "linear"),
      Tensor("attn.v_proj.weight", (h * vd, d), m + ("v_proj", "kernel"), "linear"),
      Tensor("attn.q_conv1d.weight", (h * kd, 1, w), m + ("q_conv", "kernel"), "conv"),
      Tensor("attn.k_conv1d.weight", (h * kd, 1, w), m + ("k_conv", "kernel"), "conv"),
      Tensor("attn.v_conv1d.weight", (h * vd, 1, w), m + ("v_conv", "kernel"), "conv"),
      Tensor("attn.dt_proj.weight", (h, d), m + ("dt_proj", "kernel"), "linear"),
      Tensor("attn.bs_proj.weight", (h, d), m + ("s_proj", "kernel"), "linear"),
      Tensor("attn.A_log", (h,), m + ("A_log",)),
      Tensor("attn.dt_bias", (h,), m + ("dt_bias",)),
      Tensor("attn.D", (h,), m + ("D",)),
      Tensor("attn.g_proj.weight", (h * vd, d), m + ("gate_proj", "kernel"), "linear"),
      Tensor("attn.o_norm.weight", (vd,), m + ("out_norm", "scale")),
      Tensor("attn.o_proj.weight", (d, h * vd), m + ("out_proj", "kernel"), "linear"),
  ]
  beta = [("attn.b_rank_proj.weight", (r, d), "beta_down", 0.0),
          ("attn.b_proj.weight", (h * vd, r), "beta_up", 0.0),
          ("attn.b_scale", (h,), "b_scale", 1.0), ("attn.Ip_log", (h,), "Ip_log", 0.0)]
  return ([Tensor("attn_norm.weight", (d,), ("mixer_norm", "scale"))] + mixer
          + _beta_tensors(beta, metaplastic) + [
              Tensor("mlp_norm.weight", (d,), ("mlp_norm", "scale")),
              Tensor("mlp.gate_proj.weight", (f, d), ("mlp", "gate_proj", "kernel"), "linear"),
              Tensor("mlp.up_proj.weight", (f, d), ("mlp", "up_proj", "kernel"), "linear"),
              Tensor("mlp.down_proj.weight", (d, f), ("mlp", "down_proj", "kernel"), "linear")])


def _meta_mamba2_layer(config: ml_collections.ConfigDict, metaplastic: bool) -> list[Tensor]:
  d, di = config.d_model, config.expand * config.d_model
  h, r, w = di // config.head_dim, config.beta_rank, config.conv_kernel
  xbc = di + 2 * config.num_groups * config.state_dim
  m = ("mixer",)
  beta = [("mixer.b_rank_proj.weight", (r, d), "beta_down", 0.0),
          ("mixer.b_proj.weight", (di, r), "beta_up", 0.0),
          ("mixer.b_scale", (h,), "b_scale", 1.0), ("mixer.Ip_log", (h,), "Ip_log", 0.0)]
  return [
      Tensor("norm.weight", (d,), ("mixer_norm", "scale")),
      Tensor("mixer.in_proj.weight", (di + xbc + h, d), m + ("in_proj", "kernel"), "linear"),
      Tensor("mixer.conv1d.weight", (xbc, 1, w), m + ("conv", "kernel"), "conv"),
      Tensor("mixer.conv1d.bias", (xbc,), m + ("conv", "bias")),
      Tensor("mixer.A_log", (h,), m + ("A_log",)),
      Tensor("mixer.dt_bias", (h,), m + ("dt_bias",)),
      Tensor("mixer.D", (h,), m + ("D",)),
      Tensor("mixer.norm.weight", (di,), m + ("norm", "scale")),
      Tensor("mixer.out_proj.weight", (d, di), m + ("out_proj", "kernel"), "linear"),
  ] + _beta_tensors(beta, metaplastic)


def _beta_tensors(beta: list[tuple], metaplastic: bool) -> list[Tensor]:
  """The four beta tensors: mapped when metaplastic, else present but unused."""
  tensors = []
  for name, shape, ours, fill in beta:
    path = None
    if metaplastic:
      path = ("mixer", ours, "kernel") if ours.startswith("beta_") else ("mixer", ours)
    tensors.append(Tensor(name, shape, path, "linear" if ours.startswith("beta_") else "same",
                          fill))
  return tensors


def tensor_table(config: ml_collections.ConfigDict) -> list[Tensor]:
  """Every tensor of the authors' checkpoint of our model `config`, lm_head excluded."""
  model_type = authors_model_type(config)
  prefix = PREFIXES[model_type]
  metaplastic = bool(models.metaplastic_layers(config))
  layer = _palimpsa_layer if model_type == "palimpsa" else _meta_mamba2_layer
  final_norm = "norm" if model_type == "palimpsa" else "norm_f"
  table = [Tensor(f"{prefix}.embeddings.weight", (config.vocab_size, config.d_model), ("embed",)),
           Tensor(f"{prefix}.{final_norm}.weight", (config.d_model,), ("final_norm", "scale"))]
  for i in range(config.num_layers):
    for t in layer(config, metaplastic):
      path = None if t.path is None else ("blocks", i) + t.path
      table.append(dataclasses.replace(t, name=f"{prefix}.layers.{i}.{t.name}", path=path))
  return table

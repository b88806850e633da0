"""Synthetic checkpoints of the authors' PyTorch models and a NumPy forward of them.

The tensor names and shapes are written out here from the authors' layer code
(palimpsa/layers/palimpsa.py, meta_mamba2.py, and FLA's GatedMLP and
ShortConvolution), independently of torch_layouts.py, and the reference forward
runs on those torch-layout tensors in float64, so a wrong name, transpose,
split or parametrisation in the importer shows up as a logits mismatch.
"""

import json
import os

import numpy as np

VOCAB, D, LAYERS = 32, 16, 2


def hf_config(model_type: str, metaplasticity: bool = True) -> dict:
  """A tiny config.json of the authors' palimpsa or meta_mamba2 model."""
  if model_type == "palimpsa":
    return dict(model_type="palimpsa", architectures=["PalimpsaForCausalLM"], hidden_size=D,
                num_heads=2, head_dim=8, expand_k=1, expand_v=2, beta_step_rank=3,
                num_hidden_layers=LAYERS, vocab_size=VOCAB, intermediate_size=24,
                conv_size=4, norm_eps=1e-6, tie_word_embeddings=True,
                metaplasticity=metaplasticity)
  return dict(model_type="meta_mamba2", architectures=["MetaMamba2ForCausalLM"],
              hidden_size=D, head_dim=8, expand=2, state_size=4, n_groups=2,
              conv_kernel=4, beta_step_rank=3, num_hidden_layers=LAYERS, vocab_size=VOCAB,
              norm_eps=1e-5, tie_word_embeddings=True, use_bias=False, use_conv_bias=True,
              time_step_limit=[0.0, {"__float__": "Infinity"}],  # as transformers 5 writes it
              metaplasticity=metaplasticity)


def tensor_shapes(cfg: dict) -> dict[str, tuple]:
  """Every tensor of the authors' model for config `cfg` (lm_head included)."""
  d, r = cfg["hidden_size"], cfg["beta_step_rank"]
  if cfg["model_type"] == "palimpsa":
    h, kd = cfg["num_heads"], cfg["head_dim"] * cfg["expand_k"]
    vd, f, w = cfg["head_dim"] * cfg["expand_v"], cfg["intermediate_size"], cfg["conv_size"]
    layer = {"attn_norm.weight": (d,), "attn.q_proj.weight": (h * kd, d),
             "attn.k_proj.weight": (h * kd, d), "attn.v_proj.weight": (h * vd, d),
             "attn.b_rank_proj.weight": (r, d), "attn.b_proj.weight": (h * vd, r),
             "attn.b_scale": (h,), "attn.bs_proj.weight": (h, d), "attn.Ip_log": (h,),
             "attn.dt_proj.weight": (h, d), "attn.A_log": (h,), "attn.dt_bias": (h,),
             "attn.q_conv1d.weight": (h * kd, 1, w), "attn.k_conv1d.weight": (h * kd, 1, w),
             "attn.v_conv1d.weight": (h * vd, 1, w), "attn.D": (h,),
             "attn.g_proj.weight": (h * vd, d), "attn.o_norm.weight": (vd,),
             "attn.o_proj.weight": (d, h * vd), "mlp_norm.weight": (d,),
             "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
             "mlp.down_proj.weight": (d, f)}
    prefix, final = "model", "model.norm.weight"
  else:
    di = cfg["expand"] * d
    h, xbc = di // cfg["head_dim"], di + 2 * cfg["n_groups"] * cfg["state_size"]
    layer = {"norm.weight": (d,), "mixer.in_proj.weight": (di + xbc + h, d),
             "mixer.conv1d.weight": (xbc, 1, cfg["conv_kernel"]), "mixer.conv1d.bias": (xbc,),
             "mixer.dt_bias": (h,), "mixer.A_log": (h,), "mixer.norm.weight": (di,),
             "mixer.D": (h,), "mixer.out_proj.weight": (d, di),
             "mixer.b_rank_proj.weight": (r, d), "mixer.b_proj.weight": (di, r),
             "mixer.b_scale": (h,), "mixer.Ip_log": (h,)}
    prefix, final = "backbone", "backbone.norm_f.weight"
  shapes = {f"{prefix}.embeddings.weight": (cfg["vocab_size"], d), final: (d,),
            "lm_head.weight": (cfg["vocab_size"], d)}
  for i in range(cfg["num_hidden_layers"]):
    shapes.update({f"{prefix}.layers.{i}.{name}": s for name, s in layer.items()})
  return shapes


def random_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """Random float32 tensors under the authors' names, gates kept in a sensible range."""
  rng = np.random.default_rng(seed)
  tensors = {}
  for name, shape in tensor_shapes(cfg).items():
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if name.endswith("A_log"):
      value = np.log(rng.uniform(0.05, 2.0, shape))
    elif name.endswith("dt_bias"):
      value = rng.uniform(-3.0, 0.5, shape)
    elif name.endswith("Ip_log"):
      value = rng.uniform(-0.5, 0.5, shape)
    elif "norm" in leaf or name.endswith(".D"):
      value = 1.0 + 0.2 * rng.standard_normal(shape)
    else:
      value = 0.4 * rng.standard_normal(shape)
    tensors[name] = value.astype(np.float32)
  embedding = [n for n in tensors if n.endswith("embeddings.weight")][0]
  tensors["lm_head.weight"] = tensors[embedding].copy()
  return tensors


def write_checkpoint(folder: str, cfg: dict, tensors: dict[str, np.ndarray]) -> str:
  """config.json + model.safetensors in `folder`, as the authors' save_pretrained writes."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(cfg, f)
  save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
  return folder


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _softplus(x):
  return np.logaddexp(0.0, x)


def _linear(x, w):
  return x @ w.T  # torch Linear: weight [out, in]


def _causal_conv(x, w, bias=None):
  """x [B, T, C], torch depthwise Conv1d weight [C, 1, W], padded W - 1 on the left."""
  width = w.shape[-1]
  padded = np.concatenate([np.zeros(x.shape[:1] + (width - 1,) + x.shape[2:]), x], axis=1)
  y = sum(padded[:, i:i + x.shape[1]] * w[:, 0, i] for i in range(width))
  return y if bias is None else y + bias


def _heads(x, size):
  return x.reshape(*x.shape[:-1], -1, size)


def _recurrence(q, k, v, b, dt, a, ip, scale):
  """Palimpsa in its linear form, as the authors' fused_recurrent kernel: o [B, T, H, V]."""
  batch, length, h, kd = k.shape
  m = np.zeros((batch, h, v.shape[-1], kd))
  ibar = np.zeros_like(m)
  out = np.zeros(v.shape)
  for t in range(length):
    decay = np.exp(-dt[:, t] * a)[..., None, None]  # [B, H, 1, 1]
    m = m * decay + v[:, t, :, :, None] * k[:, t, :, None, :]
    if b is not None:
      ibar = ibar * decay + b[:, t, :, :, None] * (k[:, t, :, None, :] ** 2)
    out[:, t] = np.einsum("bhvk,bhk->bhv", m / (ibar + ip[None, :, None, None]), q[:, t]) * scale
  return out


def _normalize(x):
  """torch.nn.functional.normalize(x, dim=-1)."""
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _palimpsa_mixer(x, t, cfg, metaplastic):
  kd, vd = cfg["head_dim"] * cfg["expand_k"], cfg["head_dim"] * cfg["expand_v"]
  q = _heads(_silu(_causal_conv(_linear(x, t["q_proj.weight"]), t["q_conv1d.weight"])), kd)
  k = _heads(_silu(_causal_conv(_linear(x, t["k_proj.weight"]), t["k_conv1d.weight"])), kd)
  xv = _heads(_silu(_causal_conv(_linear(x, t["v_proj.weight"]), t["v_conv1d.weight"])), vd)
  dt = _softplus(_linear(x, t["dt_proj.weight"]) + t["dt_bias"])
  q, k = _normalize(q), _normalize(k)
  bs = _sigmoid(_linear(x, t["bs_proj.weight"]))[..., None]
  b = None
  if metaplastic:
    raw = _heads(_linear(_linear(x, t["b_rank_proj.weight"]), t["b_proj.weight"]), vd)
    b = _sigmoid(raw) * _softplus(t["b_scale"])[:, None] * bs
  ip = np.exp(t["Ip_log"]) if metaplastic else np.ones_like(t["A_log"])
  o = _recurrence(q, k, xv * bs, b, dt, np.exp(t["A_log"]), ip, kd ** -0.5)
  o = o + xv * t["D"][:, None]
  g = _heads(_linear(x, t["g_proj.weight"]), vd)
  o = _rms(o, t["o_norm.weight"], cfg["norm_eps"]) * _silu(g)
  return _linear(o.reshape(*o.shape[:2], -1), t["o_proj.weight"])


def _meta_mamba2_mixer(x, t, cfg, metaplastic):
  di, n, g = cfg["expand"] * cfg["hidden_size"], cfg["state_size"], cfg["n_groups"]
  h, p = di // cfg["head_dim"], cfg["head_dim"]
  gate, xbc, dt = np.split(_linear(x, t["in_proj.weight"]), [di, 2 * di + 2 * g * n], axis=-1)
  xbc = _silu(_causal_conv(xbc, t["conv1d.weight"], t["conv1d.bias"]))
  xs, bb, cc = np.split(xbc, [di, di + g * n], axis=-1)
  bb = np.repeat(_heads(bb, n), h // g, axis=2)  # '(h g)': group j serves heads j*h/g ...
  cc = np.repeat(_heads(cc, n), h // g, axis=2)
  xs = _heads(xs, p)
  dt = _softplus(dt + t["dt_bias"])
  b = None
  if metaplastic:
    raw = _heads(_linear(_linear(x, t["b_rank_proj.weight"]), t["b_proj.weight"]), p)
    b = _sigmoid(raw) * _softplus(t["b_scale"])[:, None] * dt[..., None]
  ip = np.exp(t["Ip_log"]) if metaplastic else np.ones_like(t["A_log"])
  o = _recurrence(cc, bb, xs * dt[..., None], b, dt, np.exp(t["A_log"]), ip, 1.0)
  o = (o + xs * t["D"][:, None]).reshape(*o.shape[:2], di)
  o = _rms(o * _silu(gate), t["norm.weight"], cfg["norm_eps"])  # one group: the whole width
  return _linear(o, t["out_proj.weight"])


def reference_logits(cfg: dict, tensors: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
  """The authors' model's logits [B, T, V] in float64, from its torch-layout tensors."""
  t64 = {name: np.asarray(v, np.float64) for name, v in tensors.items()}
  palimpsa = cfg["model_type"] == "palimpsa"
  prefix = "model" if palimpsa else "backbone"
  eps, meta = cfg["norm_eps"], cfg.get("metaplasticity", True)
  h = t64[f"{prefix}.embeddings.weight"][tokens]
  for i in range(cfg["num_hidden_layers"]):
    name = f"{prefix}.layers.{i}."
    sub = lambda part: {n[len(name + part):]: v for n, v in t64.items()
                        if n.startswith(name + part)}
    if palimpsa:
      h = h + _palimpsa_mixer(_rms(h, t64[name + "attn_norm.weight"], eps), sub("attn."), cfg, meta)
      mlp = sub("mlp.")
      x = _rms(h, t64[name + "mlp_norm.weight"], eps)
      hidden = _silu(_linear(x, mlp["gate_proj.weight"])) * _linear(x, mlp["up_proj.weight"])
      h = h + _linear(hidden, mlp["down_proj.weight"])
    else:
      h = h + _meta_mamba2_mixer(_rms(h, t64[name + "norm.weight"], eps), sub("mixer."), cfg, meta)
  h = _rms(h, t64[f"{prefix}.norm.weight" if palimpsa else f"{prefix}.norm_f.weight"], eps)
  return h @ t64["lm_head.weight"].T

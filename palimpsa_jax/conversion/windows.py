"""Memory windows N = 1 / (1 - exp(-A dt)) per layer, and choosing layers by them.

A head forgets at rate alpha = exp(-A dt) per token, so it remembers about
N = 1 / (1 - alpha) tokens. The layers with the largest window averaged over
heads forget the least; the paper converts those (docs/models.md). dt is softplus(dt_bias)
(the gate with a zero input projection), or measured: its mean over the tokens
of a calibration batch.
"""

from collections.abc import Sequence
import dataclasses
import re

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np


def head_windows(a_log: np.ndarray, dt: np.ndarray) -> np.ndarray:
  """N = 1 / (1 - exp(-A dt)) per head; a_log, dt [..., H] -> [..., H] float64."""
  a_dt = np.exp(np.asarray(a_log, np.float64)) * np.asarray(dt, np.float64)
  return 1.0 / -np.expm1(-a_dt)


def _softplus(x: np.ndarray) -> np.ndarray:
  x = np.asarray(x, np.float64)
  return np.logaddexp(x, 0.0)


def bias_dt(params: dict, num_layers: int) -> np.ndarray:
  """dt = softplus(dt_bias) of every layer, [L, H]."""
  return np.stack([_softplus(params["blocks"][i]["mixer"]["dt_bias"])
                   for i in range(num_layers)])


def _mixer_dt(mixer: nnx.Module, x: jax.Array) -> jax.Array:
  """dt [B, T, H] of a MetaMamba2 or PalimpsaD mixer for its input x [B, T, d]."""
  if hasattr(mixer, "in_proj"):  # MetaMamba2: in_proj = [z, xBC, dt]
    raw = mixer.in_proj(x)[..., -mixer.num_heads:]
  else:  # PalimpsaD
    raw = mixer.dt_proj(x)
  return jax.nn.softplus(raw.astype(jnp.float32) + mixer.dt_bias[...])


@nnx.jit
def _measured_dt(model: nnx.Module, tokens: jax.Array) -> jax.Array:
  h = jnp.take(model.embed[...], tokens, axis=0).astype(model.residual_dtype)
  per_layer = []
  for block in model.layer_blocks():
    dt = _mixer_dt(block.mixer, block.mixer_norm(h))
    per_layer.append(jnp.mean(dt, axis=(0, 1)))
    h, _ = block(h, None, False)
  return jnp.stack(per_layer)


def measured_dt(model: nnx.Module, tokens: np.ndarray) -> np.ndarray:
  """Mean dt over a calibration batch, [L, H]; tokens [B, T] int."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must be [B, T] integers, got {tokens.shape} {tokens.dtype}")
  return np.asarray(_measured_dt(model, jnp.asarray(tokens, jnp.int32)), np.float64)


def layer_windows(params: dict, dt: np.ndarray) -> np.ndarray:
  """Per-head windows [L, H] from the layers' A_log and dt [L, H]."""
  a_log = np.stack([np.asarray(params["blocks"][i]["mixer"]["A_log"])
                    for i in range(dt.shape[0])])
  return head_windows(a_log, dt)


@dataclasses.dataclass(frozen=True)
class LayerChoice:
  """Which layers to convert: `count` by window ("auto:N"), or explicit `layers`."""
  count: int | None = None
  layers: tuple[int, ...] = ()


def parse_layers(spec: str) -> LayerChoice:
  """"auto:N" | "i,j,k" | "none" -> LayerChoice."""
  spec = spec.strip()
  if spec == "none":
    return LayerChoice(layers=())
  match = re.fullmatch(r"auto:(\d+)", spec)
  if match:
    count = int(match.group(1))
    if count < 1:
      raise ValueError(f"--layers auto:N needs N >= 1, got {spec!r}")
    return LayerChoice(count=count)
  if re.fullmatch(r"\d+(,\d+)*", spec):
    return LayerChoice(layers=tuple(int(i) for i in spec.split(",")))
  raise ValueError(f"--layers must be 'auto:N', 'i,j,k' or 'none', got {spec!r}")


def choose_layers(windows: np.ndarray, count: int,
                  exclude: Sequence[int] = ()) -> list[int]:
  """The `count` layers with the largest head-mean window, largest first.

  Args:
    windows: [L, H] per-head windows.
    count: how many layers.
    exclude: layers that cannot be chosen (already metaplastic).
  """
  candidates = [i for i in range(windows.shape[0]) if i not in set(exclude)]
  if count > len(candidates):
    raise ValueError(
        f"auto:{count} asks for more layers than the {len(candidates)} convertible ones")
  mean = windows.mean(axis=1)
  return sorted(candidates, key=lambda i: (-mean[i], i))[:count]


def window_table(windows: np.ndarray, chosen: Sequence[int], dt_source: str) -> str:
  """A text table: layer, mean / min / max window over heads, converted mark."""
  lines = [f"memory window N = 1/(1 - exp(-A dt)), dt from {dt_source}",
           f"{'layer':>5}  {'mean N':>10}  {'min N':>10}  {'max N':>10}  converted"]
  for i, row in enumerate(windows):
    mark = "yes" if i in set(chosen) else ""
    lines.append(f"{i:>5}  {row.mean():>10.1f}  {row.min():>10.1f}  {row.max():>10.1f}  {mark}")
  return "\n".join(lines)

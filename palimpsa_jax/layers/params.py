"""Parameter creation with logical sharding names, and the initialisers of docs/models.md, layers."""

from collections.abc import Callable, Sequence
import math

import jax
import jax.numpy as jnp
from flax import nnx

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]

INIT_STD = 0.02
LOGICAL_AXES = ("vocab", "embed", "heads", "kv", "mlp", "rank", "conv", None)


def make_param(
    value: jax.Array, names: Sequence[str | None]
) -> nnx.Param:
  """Wraps a float32 array as a Param carrying logical axis names.

  The names are stored as `out_sharding` metadata with eager sharding off, so
  the training code maps them to mesh axes with `nnx.get_partition_spec` under
  its logical-axis rules.
  """
  names = tuple(names)
  if len(names) != value.ndim:
    raise ValueError(
        f"names {names} must name every axis of a parameter of shape "
        f"{value.shape}")
  for name in names:
    if name not in LOGICAL_AXES:
      raise ValueError(f"logical axis name {name!r} not in {LOGICAL_AXES}")
  return nnx.Param(
      jnp.asarray(value, jnp.float32), out_sharding=names,
      eager_sharding=False)


def normal_init(std: float = INIT_STD) -> Initializer:
  return jax.nn.initializers.normal(stddev=std)


def fan_in_uniform_init(fan_in: int) -> Initializer:
  """U(-fan_in^-1/2, fan_in^-1/2), PyTorch's default for Linear and Conv."""
  bound = 1.0 / math.sqrt(fan_in)
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)
  return init


def init_a_log(
    key: jax.Array, num_heads: int, method: str,
    init_range: tuple[float, float]) -> jax.Array:
  """log(A) per head, [H].

  method: "uniform" draws A ~ U(lo, hi); "arange" sets A = 1..H (Mamba2);
  "linspace" spreads A evenly over [lo, hi] across heads.
  """
  lo, hi = init_range
  if method == "uniform":
    a = jax.random.uniform(key, (num_heads,), jnp.float32, lo, hi)
  elif method == "arange":
    a = jnp.arange(1, num_heads + 1, dtype=jnp.float32)
  elif method == "linspace":
    a = jnp.linspace(lo, hi, num_heads, dtype=jnp.float32)
  else:
    raise ValueError(
        f"A_init must be 'uniform', 'arange' or 'linspace', got {method!r}")
  return jnp.log(jnp.maximum(a, jnp.finfo(jnp.float32).tiny))


def init_dt_bias(
    key: jax.Array, num_heads: int, dt_min: float, dt_max: float,
    dt_floor: float) -> jax.Array:
  """Inverse softplus of dt ~ log-uniform[dt_min, dt_max] (floored), [H]."""
  if not 0 < dt_min <= dt_max:
    raise ValueError(f"need 0 < dt_min <= dt_max, got {dt_min}, {dt_max}")
  u = jax.random.uniform(key, (num_heads,), jnp.float32)
  dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
  dt = jnp.maximum(dt, dt_floor)
  return dt + jnp.log(-jnp.expm1(-dt))


def forget_gate_params(
    rngs: nnx.Rngs, num_heads: int, A_init: str,
    A_init_range: tuple[float, float], dt_min: float, dt_max: float,
    dt_init_floor: float) -> tuple[nnx.Param, nnx.Param]:
  """(A_log, dt_bias), each [H] named ("heads",): log_alpha = -exp(A_log) * softplus(. + dt_bias)."""
  a_log = make_param(init_a_log(rngs.params(), num_heads, A_init, A_init_range), ("heads",))
  dt_bias = make_param(
      init_dt_bias(rngs.params(), num_heads, dt_min, dt_max, dt_init_floor), ("heads",))
  return a_log, dt_bias

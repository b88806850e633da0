"""Longhorn's state update (docs/math.md, special cases), a sequential reference, and how it
relates to Palimpsa.

Per batch element and head, with beta_t in R^V (>= 0) and no forget gate:

    eps_t = beta_t / (1 + beta_t * ||k_t||^2)                                 ([V])
    mu_t  = (1 - eps_t (x) k_t^2) * mu_{t-1} + (eps_t * v_t) (x) k_t           ([V, K])
    out_t = mu_t q_t

Each row mu[v] is one step of online regression of v_t[v] on k_t with weight beta_t[v], with the
rank-one correction k k^T of the exact solution replaced by its diagonal k^2.

Relation to Palimpsa. One Palimpsa step with alpha = 1 from precision I_{t-1} = 1 (e.g. the prior
with Ip = 1), writing the value beta_t * v_t, is

    I_t  = 1 + beta_t (x) k_t^2
    mu_t = (1 - beta_t (x) k_t^2 / I_t) * mu_{t-1} + ((beta_t * v_t) (x) k_t) / I_t,

i.e. exactly Longhorn's step with its row normaliser 1 + beta_t[v] ||k_t||^2 replaced by the
per-entry precision 1 + beta_t[v] k_t[j]^2. The two normalisers agree on every entry that is
written iff k_t has a single non-zero coordinate. Over several steps Palimpsa also keeps the
precision it accumulated (I_t = 1 + sum_s beta_s (x) k_s^2 when alpha = 1), whereas Longhorn
restarts from precision 1 at every step; so whole sequences agree exactly when each key has one
non-zero coordinate and no coordinate is written twice (e.g. scaled distinct basis vectors, T <= K).
"""

from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from palimpsa_jax.ops.common import check_array, check_sequences


class LonghornResult(NamedTuple):
  """What `longhorn` returns.

  out:   [B, T, H, V], dtype of v: readout mu_t q_t.
  state: [B, H, V, K] float32, mu after the last step.
  """

  out: jax.Array
  state: jax.Array


def longhorn(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    beta: jax.Array,
    *,
    initial_state: jax.Array | None = None,
) -> LonghornResult:
  """Runs Longhorn's diagonal update step by step (lax.scan over time, float32).

  Args:
    q: [B, T, H, K] queries.
    k: [B, T, H, K] keys.
    v: [B, T, H, V] values.
    beta: [B, T, H, V] per-entry step sizes, expected >= 0.
    initial_state: [B, H, V, K] mu before step 0; zeros if None.

  Returns:
    LonghornResult(out [B, T, H, V] in v's dtype, state [B, H, V, K] float32).
  """
  batch, time, heads, key_dim, value_dim = check_sequences(q, k, v, initial_state, None)
  check_array("beta", beta, (batch, time, heads, value_dim), "[B, T, H, V]")
  f32 = jnp.float32
  state_shape = (batch, heads, value_dim, key_dim)
  mu0 = jnp.zeros(state_shape, f32) if initial_state is None else initial_state.astype(f32)

  def step(mu, xs):
    q_t, k_t, v_t, beta_t = xs
    eps = beta_t / (1.0 + beta_t * jnp.sum(k_t * k_t, axis=-1, keepdims=True))  # [B, H, V]
    mu = (1.0 - eps[..., :, None] * jnp.square(k_t)[..., None, :]) * mu
    mu = mu + (eps * v_t)[..., :, None] * k_t[..., None, :]
    return mu, jnp.einsum("bhvk,bhk->bhv", mu, q_t, precision=lax.Precision.HIGHEST)

  xs = tuple(jnp.moveaxis(x.astype(f32), 1, 0) for x in (q, k, v, beta))
  state, out = lax.scan(step, mu0, xs)
  return LonghornResult(jnp.moveaxis(out, 0, 1).astype(v.dtype), state)

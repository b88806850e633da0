"""A training step's device memory, estimated before compiling: what remat to run with.

A block's backward keeps some of its forward's arrays. `kept_bytes` traces one block on the
program a GPU runs (the Palimpsa mixers on their Pallas kernels) and sums what jax's
saved-residuals machinery lists, per token: nothing is compiled or run, so any model and
size takes seconds on a CPU. The compiled step holds more than that sum (layout copies, the
backward's temporaries, the scan's buffers): `estimated_step_gib` scales it by
COMPILED_OVER_TRACED, the ratio the GPU records show, and adds the optimizer's state.
`remat_choice` takes the fastest policy whose estimate fits a budget (docs/activation_memory.md).
"""

from collections.abc import Callable
import contextlib
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from palimpsa_jax.models import config as model_configs
from palimpsa_jax.models import registry
from palimpsa_jax.models.summary import abstract_parameter_count
from palimpsa_jax.models.language_model import REMAT_SAVES, Block, build_model
from pallas_kernels.palimpsa_gpu import op as gpu_op

# jax.ad_checkpoint.print_saved_residuals only prints; its engine, saved_residuals, returns
# (aval, where it comes from) for every array the vjp keeps, from make_jaxpr of jax.vjp: the
# exact set the backward reads (arguments, literals and intermediates, each array once),
# without lowering or compiling. It is private in jax 0.11.2 but is what the public
# printer calls; summing residual avals of a hand-traced vjp would repeat its bookkeeping.
from jax._src.ad_checkpoint import saved_residuals

# The compiled step's temporaries beside the gradients over the traced bytes of all layers
# (kept_bytes x layers x tokens, plus one block's bytes without remat when rematerialised):
# what XLA adds to the arrays the backward reads. Palimpsa-D 760M, 8 x 4096 tokens, scanned,
# the compiled step's memory analysis for an H100 (XLA's GPU compiler on a CPU host,
# benchmarks/step/compiled.py; 2026-12-06, records compiled_step_*: the same analysis a GPU's
# compile gives): 1.12 exact and 1.21 rank1 without remat, 1.15 exact and 1.27 rank1 with
# remat_saves="matmuls_readouts_and_states"; the largest, rounded up.
# tests/models/test_activation_memory.py holds this to the newest such record of each.
COMPILED_OVER_TRACED = 1.28
# Float32 parameters, their gradients and AdamW's two moments.
STATE_BYTES_PER_PARAMETER = 16
# remat_saves policies from the fewest recomputations to the most: without remat first.
POLICIES = (None, "matmuls_readouts_and_states", "matmuls_and_readouts", "matmuls", "nothing")


@contextlib.contextmanager
def gpu_kernel_tracing():
  """Lets the GPU kernel path be traced on a host without a GPU: the op's platform check
  guards compiled runs, and nothing here is compiled."""
  with mock.patch.object(gpu_op, "_check_nvidia_gpu", lambda: None):
    yield


def gpu_program(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """config with the implementation a GPU runs: the metaplastic mixers' Pallas kernels."""
  config = config.copy_and_resolve_references()
  if registry.kind(config).metaplastic:
    config.implementation = "pallas_gpu"
  return config


def kept_bytes(config: ml_collections.ConfigDict, batch: int, seq_len: int,
               remat_saves: str | None = None) -> dict[str, float]:
  """What one Block of `config` keeps for its backward on a [batch, seq_len] input.

  Returns {"per_token": bytes per token, "float32": the float32 part of it}; remat_saves
  None is no remat, else a config.remat_saves policy around the block. Parameters are left
  out (they stay in memory anyway); the compute-dtype copies of weights it keeps count.
  """
  block = nnx.eval_shape(lambda: Block(config, nnx.Rngs(0)))
  graphdef, params = nnx.split(block)
  residual_dtype = jnp.float32 if config.residual_in_fp32 else jnp.dtype(config.dtype)
  h = jax.ShapeDtypeStruct((batch, seq_len, config.d_model), residual_dtype)

  def run(params, h):
    return nnx.merge(graphdef, params)(h, None, False)[0]

  if remat_saves is not None:
    run = jax.checkpoint(run, policy=REMAT_SAVES[remat_saves])
  with gpu_kernel_tracing():
    saved = saved_residuals(run, params, h)
  kept = [aval for aval, source in saved if not source.startswith("from the argument params")]
  size = lambda aval: aval.size * aval.dtype.itemsize
  tokens = batch * seq_len
  return {"per_token": sum(map(size, kept)) / tokens,
          "float32": sum(size(a) for a in kept if a.dtype == jnp.float32) / tokens}


def estimated_step_gib(config: ml_collections.ConfigDict, batch: int, seq_len: int,
                       remat_saves: str | None) -> float:
  """The compiled train step's peak memory on one device, GiB: batch x seq_len tokens,
  remat under `remat_saves` (None: no remat), the GPU program of `config`."""
  return _estimator(config, batch, seq_len)(remat_saves)


def remat_choice(config: ml_collections.ConfigDict, batch: int, seq_len: int,
                 budget_gib: float) -> tuple[bool, str]:
  """(remat, remat_saves): the first of POLICIES whose estimated step fits budget_gib, or
  the last one (keeping least) when none does."""
  estimate = _estimator(config, batch, seq_len)
  for saves in POLICIES:
    if estimate(saves) <= budget_gib:
      break
  return saves is not None, saves or "nothing"


@functools.cache
def sized_remat_choice(model: str, size: str, precision: str, dtype: str, batch: int,
                       seq_len: int, budget_gib: float) -> tuple[bool, str]:
  """remat_choice for models.model_config(model, size, dtype=, precision=) (cached: it
  traces a few blocks, seconds each)."""
  config = model_configs.model_config(model, size, dtype=dtype, precision=precision)
  return remat_choice(config, batch, seq_len, budget_gib)


def _estimator(config, batch, seq_len) -> Callable[[str | None], float]:
  """remat_saves -> estimated_step_gib, with the block traced without remat once."""
  config = gpu_program(config)
  plain = kept_bytes(config, batch, seq_len)["per_token"]
  state = STATE_BYTES_PER_PARAMETER * abstract_parameter_count(config, build_model)

  def estimate(saves):
    traced = plain * config.num_layers
    if saves is not None:  # Every layer keeps what saves names; one runs its backward.
      traced = kept_bytes(config, batch, seq_len, saves)["per_token"] * config.num_layers + plain
    return (COMPILED_OVER_TRACED * traced * batch * seq_len + state) / 2**30

  return estimate

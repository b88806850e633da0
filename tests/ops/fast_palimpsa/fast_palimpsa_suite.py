"""Fast Palimpsa's shared checks against the float64 reference: each implementation's output,
variance, final state and gradients (used by the op's tests and the GPU kernel's)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from palimpsa_jax.ops import fast_palimpsa
from palimpsa_jax.ops.fast_palimpsa import reference_fast_palimpsa
from tests.ops.numerics import assert_close_to_reference
from tests.ops.palimpsa.palimpsa_suite import (DIFF_ARGS, make_inputs, random_cotangents,
                                               result_and_grads)

RESULTS = ("out", "variance", "mu", "precision")
GRADS = tuple(f"d{n}" for n in DIFF_ARGS)


@functools.partial(jax.jit, static_argnames=("implementation", "chunk_size", "interpret"))
def op_with_grads(diff, seg, cotangents, implementation, chunk_size, interpret=False):
  fn = functools.partial(fast_palimpsa, return_variance=True, implementation=implementation,
                         chunk_size=chunk_size, interpret=interpret)
  return result_and_grads(fn, diff, seg, cotangents)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def _reference_with_grads(diff, seg, cotangents, chunk_size):
  return result_and_grads(functools.partial(reference_fast_palimpsa, chunk_size=chunk_size),
                          diff, seg, cotangents)


def reference(x, cotangents, chunk_size):
  with jax.enable_x64(True):
    diff = tuple(jnp.asarray(x[n], jnp.float64) for n in DIFF_ARGS)
    seg = None if x.get("segment_ids") is None else jnp.asarray(x["segment_ids"])
    cts = tuple(jnp.asarray(c, jnp.float64) for c in cotangents)
    return jax.tree.map(np.asarray, _reference_with_grads(diff, seg, cts, chunk_size))


def check_against_reference(implementation, seed, shape, chunk, lengths, dtype, fwd_tol,
                            grad_tol, interpret=False):
  """Output, variance, final state and the grads of all eight inputs (initial state
  included) of `implementation` against the float64 reference, on fresh random inputs."""
  x = make_inputs(seed, shape, dtype, lengths)
  cts = random_cotangents(seed + 1, shape)
  diff = tuple(jnp.asarray(x[n], dtype if i < 6 else jnp.float32)
               for i, n in enumerate(DIFF_ARGS))
  seg = None if lengths is None else jnp.asarray(x["segment_ids"])
  res, grads = op_with_grads(diff, seg, cts, implementation, chunk, interpret)
  ref_res, ref_grads = reference(x, cts, chunk)
  b, t, h, kd, vd = shape
  chex.assert_shape(res, [(b, t, h, vd), (b, t, h, vd), (b, h, vd, kd), (b, h, vd, kd)])
  chex.assert_type(res, [dtype, jnp.float32, jnp.float32, jnp.float32])
  label = f"{implementation} {shape} C={chunk} {jnp.dtype(dtype).name} "
  assert_close_to_reference(dict(zip(RESULTS, res)), dict(zip(RESULTS, ref_res)), fwd_tol, label)
  assert_close_to_reference(dict(zip(GRADS, grads)), dict(zip(GRADS, ref_grads)), grad_tol,
                            label)

"""The checks every recurrent op of palimpsa_jax/ops shares, against its float64 reference.

A test file subclasses `RecurrentOpSuite` and gives its op (OP, its call's OPTIONS), fresh
random `inputs` and the float64 `reference`; the suite then checks each of IMPLEMENTATIONS:
the forward jitted and eagerly (chex variants), the gradients of every input (initial state
included), chunk sizes, bfloat16 inputs, continuing from a final state and segments that
restart from zero. The op's own checks (its oracle, its validation) stay in its file. The
Palimpsa ops have their larger suites (tests/ops/palimpsa/palimpsa_suite.py).
"""

import dataclasses
import functools
from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np

from tests.ops.numerics import BFLOAT16_TOL, FLOAT32_TOL, GRAD_TOL, assert_close_to_reference

B, T, H, K, V = 2, 13, 2, 4, 3
CHUNK = 4


@dataclasses.dataclass(frozen=True)
class OpInputs:
  """One call's inputs: the op's positional arguments, then its initial state and segments.

  Attributes:
    sequences: the [B, T, ...] arguments (cut along time to split a run).
    constants: the arguments without a time axis (per-head parameters), after the sequences.
    state: the initial state (float32 pytree).
    segment_ids: [B, T] int32.
  """
  sequences: tuple[jax.Array, ...]
  constants: tuple[jax.Array, ...]
  state: Any
  segment_ids: jax.Array

  def cut(self, start: int, stop: int | None = None) -> tuple[jax.Array, ...]:
    """The sequences' time steps [start, stop)."""
    return tuple(x[:, start:stop] for x in self.sequences)


def _float64(tree):
  """Every float array of `tree` as a float64 jax array (call inside enable_x64)."""
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), tree)


class RecurrentOpSuite(chex.TestCase):
  """Subclass and set OP (staticmethod), OPTIONS, `inputs` and `reference`."""

  __test__ = False  # pytest collects the subclasses only.

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    cls.__test__ = True

  OP: Callable[..., Any]
  OPTIONS: dict[str, Any] = {}  # further keyword arguments of every call
  IMPLEMENTATIONS = ("sequential", "chunked")

  def inputs(self, seed: int, time: int = T, dtype=jnp.float32) -> OpInputs:
    """Fresh random inputs, the floats of sequences and constants in dtype."""
    raise NotImplementedError

  def reference(self, sequences, constants, state, segment_ids):
    """(out, final state) of the float64 reference (float64 inputs, inside enable_x64)."""
    raise NotImplementedError

  def comparable_gradients(self, gradients):
    """The parts of (d sequences, d constants, d state) the op must match; all by default."""
    return gradients

  def call(self, sequences, constants, state=None, segment_ids=None, *, implementation,
           chunk_size=CHUNK):
    """The op's result (.out, .state) on these arguments."""
    return type(self).OP(*sequences, *constants, initial_state=state, segment_ids=segment_ids,
                         implementation=implementation, chunk_size=chunk_size, **self.OPTIONS)

  def _run(self, x: OpInputs, implementation, chunk_size=CHUNK, segment_ids=True):
    """The jitted op on x; segment_ids=False leaves x's segments out."""
    fn = jax.jit(functools.partial(self.call, implementation=implementation,
                                   chunk_size=chunk_size))
    return fn(x.sequences, x.constants, x.state, x.segment_ids if segment_ids else None)

  def _reference(self, x: OpInputs):
    """float64 (out, state) as numpy arrays."""
    with jax.enable_x64(True):
      out, state = self.reference(*_float64((x.sequences, x.constants, x.state)), x.segment_ids)
      return jax.tree.map(np.asarray, (out, state))

  def _check_forward(self, result, x: OpInputs, tol: float, label: str = ""):
    ref_out, ref_state = self._reference(x)
    assert_close_to_reference(dict(out=result.out, state=result.state),
                              dict(out=ref_out, state=ref_state), tol, label)

  @chex.variants(with_jit=True, without_jit=True)
  def test_forward_matches_float64_reference(self):
    x = self.inputs(0)
    run = self.variant(self.call, static_argnames=("implementation", "chunk_size"))
    for implementation in self.IMPLEMENTATIONS:
      result = run(x.sequences, x.constants, x.state, x.segment_ids,
                   implementation=implementation)
      chex.assert_type(result.out, jnp.float32)
      chex.assert_shape(result.out, (B, T, H, V))
      chex.assert_trees_all_equal_shapes_and_dtypes(result.state, x.state)
      self._check_forward(result, x, FLOAT32_TOL, f"{implementation} ")

  def test_gradients_match_float64_reference(self):
    x = self.inputs(2)
    ref_out, ref_state = self._reference(x)
    rng = np.random.default_rng(3)
    weights = [rng.standard_normal(np.shape(leaf))
               for leaf in jax.tree.leaves((ref_out, ref_state))]

    def loss(fn):
      def value(diff, segment_ids):
        out, state = fn(*diff, segment_ids)
        return sum(jnp.sum(y * w) for y, w in zip(jax.tree.leaves((out, state)), weights))
      return value

    diff = (x.sequences, x.constants, x.state)
    with jax.enable_x64(True):
      ref = jax.grad(loss(self.reference))(_float64(diff), x.segment_ids)
      ref = self.comparable_gradients(jax.tree.map(np.asarray, ref))
    for implementation in self.IMPLEMENTATIONS:
      op = lambda *args, impl=implementation: (
          lambda r: (r.out, r.state))(self.call(*args, implementation=impl))
      grads = jax.jit(jax.grad(loss(op)))(diff, x.segment_ids)
      grads = self.comparable_gradients(jax.tree.map(np.asarray, grads))
      assert_close_to_reference(grads, ref, GRAD_TOL, f"{implementation} d")

  def test_chunk_sizes_agree(self):
    x = self.inputs(1)
    for chunk_size in (1, 5, 64):
      self._check_forward(self._run(x, "chunked", chunk_size), x, FLOAT32_TOL,
                          f"chunk_size {chunk_size} ")

  def test_bfloat16_inputs(self):
    x = self.inputs(4, dtype=jnp.bfloat16)
    for implementation in self.IMPLEMENTATIONS:
      result = self._run(x, implementation)
      chex.assert_type(result.out, jnp.bfloat16)
      chex.assert_trees_all_equal_dtypes(result.state, x.state)
      self._check_forward(result, x, BFLOAT16_TOL, f"{implementation} ")

  def test_continuation_from_final_state(self):
    x = self.inputs(5)
    split = 6  # inside the second chunk
    for implementation in self.IMPLEMENTATIONS:
      run = functools.partial(self.call, implementation=implementation)
      full = run(x.sequences, x.constants, x.state)
      first = run(x.cut(0, split), x.constants, x.state)
      second = run(x.cut(split), x.constants, first.state)
      chex.assert_trees_all_close(
          (jnp.concatenate([first.out, second.out], 1), second.state), (full.out, full.state),
          rtol=1e-5, atol=1e-5)

  def test_segments_restart_from_zero(self):
    x = self.inputs(6)
    split = 5  # inside the second chunk
    segment_ids = jnp.asarray(np.repeat([[3] * split + [7] * (T - split)], B, axis=0),
                              jnp.int32)
    for implementation in self.IMPLEMENTATIONS:
      run = functools.partial(self.call, implementation=implementation)
      packed = run(x.sequences, x.constants, x.state, segment_ids)
      head = run(x.cut(0, split), x.constants, x.state)
      tail = run(x.cut(split), x.constants)
      chex.assert_trees_all_close(
          (packed.out[:, :split], packed.out[:, split:], packed.state),
          (head.out, tail.out, tail.state), rtol=1e-5, atol=1e-5)

"""Numerical checks shared by the op, layer and model tests, on top of chex.

The project's accuracy criterion is relative to the reference's scale: for every array,
max |actual - reference| <= tol * max |reference|, in float64 (tolerances below). chex compares
element by element, |actual - reference| <= atol + rtol * |reference|; with rtol = 0 and
atol = tol * max |reference| that is the same criterion, so `assert_close_to_reference` is one
chex call per array with that atol.

Checks that should hold both jitted and run eagerly (op by op) live in a chex.TestCase and are
decorated with @chex.variants(with_jit=True, without_jit=True); they call the code under test
through self.variant.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np

FLOAT32_TOL = 1e-5  # float32 results
GRAD_TOL = 1e-4  # float32 gradients
BFLOAT16_TOL = 2e-2  # results and gradients from bfloat16 inputs


def assert_close_to_reference(actual, reference, tol: float, label: str = "") -> None:
  """Per array of two matching pytrees: max |actual - reference| <= tol * max |reference|.

  Both are compared in float64; a failure names the array's path in the tree (pass dicts or
  named tuples to get readable names) after `label`.
  """
  chex.assert_trees_all_equal_structs(actual, reference)
  for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(reference)[0],
                               jax.tree.leaves(actual)):
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    chex.assert_equal_shape([got, want], custom_message=label + jax.tree_util.keystr(path))
    bound = tol * max(float(np.max(np.abs(want), initial=0.0)), 1e-30)
    chex.assert_trees_all_close(
        got, want, rtol=0.0, atol=bound,
        custom_message=f"{label}{jax.tree_util.keystr(path)}: max |error| must be "
                       f"<= {tol:g} * max |reference| = {bound:.3g}")


def rel_error(x, ref) -> float:
  """max |x - ref| / max |ref| in float64 (a measurement; assert with the helper above)."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def to_float64(inputs) -> list:
  """(*floats, segment_ids) -> float64 jax arrays (call inside enable_x64), ids unchanged."""
  *floats, seg = inputs
  return [jnp.asarray(np.asarray(x, np.float64)) for x in floats] + [jnp.asarray(seg)]

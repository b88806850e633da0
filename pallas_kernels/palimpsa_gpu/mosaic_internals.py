"""The private Mosaic GPU internals that the Mosaic walk relies on, in one place.

Pallas Mosaic GPU has no FMA or approximate-reciprocal primitive in jax 0.11.2, so the
walk applies single PTX instructions to its register tiles through two private helpers of
`FragmentedArray`: `_lift_fast_instr` (one instruction as an elementwise function) and
`_pointwise` (such a function over a tile's registers). Another jax may rename or drop
them; `check` then fails with a message naming the jax this was written for.
"""

import jax
from jax.experimental.mosaic import gpu as mgpu

WRITTEN_FOR_JAX = "0.11.2"
PRIVATE_NAMES = ("_lift_fast_instr", "_pointwise")


def check() -> None:
  """Raises RuntimeError unless FragmentedArray has the private helpers used here."""
  missing = [name for name in PRIVATE_NAMES if not hasattr(mgpu.FragmentedArray, name)]
  if missing:
    raise RuntimeError(
        f"the Mosaic GPU backward walk uses FragmentedArray.{', .'.join(missing)}, which jax "
        f"{jax.__version__} does not have; it was written for jax {WRITTEN_FOR_JAX}. Install "
        f"jax=={WRITTEN_FOR_JAX} or port pallas_kernels/palimpsa_gpu/mosaic_internals.py.")


def fast_instr(instruction: str):
  """The PTX `instruction` (e.g. "fma.rn.f32") as a function of scalars or vectors."""
  check()
  return mgpu.FragmentedArray._lift_fast_instr(instruction)  # pylint: disable=protected-access


def pointwise(x, op, *others):
  """op applied to the registers of the FragmentedArray x (and of `others`, alike)."""
  check()
  return x._pointwise(op, *others)  # pylint: disable=protected-access

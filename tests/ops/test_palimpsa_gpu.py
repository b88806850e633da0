"""The op suite for implementation="pallas_gpu": interpreted on CPU, compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.palimpsa_gpu import palimpsa_gpu
from tests.ops.palimpsa_suite import PalimpsaSuite


class TestPallasGpuInterpret(PalimpsaSuite):
  IMPLEMENTATION = "pallas_gpu"
  INTERPRET = True
  # Two chunks with segments (one restart inside a chunk, one on a chunk boundary).
  SHAPES = (((2, 37, 2, 8, 20), 16, ((10, 6, 21), (37,))),)
  LONG_RUN = False


@pytest.mark.gpu
class TestPallasGpuCompiled(PalimpsaSuite):
  IMPLEMENTATION = "pallas_gpu"
  INTERPRET = False
  SHAPES = PalimpsaSuite.SHAPES + (
      ((2, 300, 3, 48, 96), 64, ((100, 150, 50), (300,))),
      ((1, 200, 2, 96, 192), 64, None),
  )


def test_declines_too_large_heads():
  x = jnp.zeros((1, 4, 1, 512))
  v = jnp.zeros((1, 4, 1, 16))
  with pytest.raises(NotImplementedError, match="K, V <= 256"):
    palimpsa_gpu(x, x, v, v, jnp.zeros((1, 4, 1)), jnp.ones((1,)),
                 jnp.zeros((1, 1, 16, 512)), jnp.ones((1, 1, 16, 512)), None,
                 return_variance=False, chunk_size=64, interpret=True)

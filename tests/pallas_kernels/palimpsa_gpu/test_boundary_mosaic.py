"""boundary_mosaic.boundary_states against the Triton boundary kernel: interpreted (CPU),
compiled (-m gpu), and lowered for CUDA at the benchmarks' shapes (CPU)."""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest

# The interpreter's race-detector state (no public accessor in jax 0.11.2).
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu
from pallas_kernels.palimpsa_gpu import boundary_mosaic, boundary_triton


def _inputs(seed, b, t, h, k_dim, v_dim, chunk, dtype):
  """boundary_states' arguments: rows [B, T, H, D] in dtype, gates in (0.5, 1), random
  initial states."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 7)
  bh, nc = b * h, t // chunk
  return (
      (jax.random.normal(keys[0], (b, t, h, k_dim)) / 4).astype(dtype),
      jax.random.normal(keys[1], (b, t, h, v_dim)).astype(dtype),
      jax.random.uniform(keys[2], (b, t, h, v_dim)).astype(dtype),
      jax.random.uniform(keys[3], (bh, t), minval=0.5),
      jax.random.uniform(keys[4], (bh, nc), minval=0.5),
      jax.random.normal(keys[5], (bh, v_dim, k_dim)),
      jax.random.uniform(keys[6], (bh, v_dim, k_dim)))


def _assert_close(got, want):
  names = ("m_starts", "b_starts", "m_final", "b_final")
  for name, g, w in zip(names, got, want):
    chex.assert_equal_shape([g, w], custom_message=name)
    chex.assert_trees_all_close(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))),
                                custom_message=name)


# (B, T, H, K, V, chunk, k_part, dtype, slots): 3 chunks of 16 in one 64-row block (T
# padded), a V-tile past V=48; 5 chunks of 16 over two blocks (the second padded), f32
# rows split in terms; one 64-step chunk over three V-tiles and two K-parts; 5 blocks of
# 2 chunks through a ring of 2; 2 chunks of 128 through a ring of 1.
_CASES = [
    (1, 48, 2, 16, 48, 16, 16, jnp.bfloat16, 3),
    (1, 80, 1, 48, 16, 16, 48, jnp.float32, 3),
    (1, 64, 1, 96, 192, 64, 48, jnp.bfloat16, 3),
    (1, 320, 1, 16, 32, 32, 16, jnp.bfloat16, 2),
    (1, 256, 1, 32, 16, 128, 32, jnp.float32, 1),
]


@pytest.mark.parametrize("b, t, h, k_dim, v_dim, chunk, k_part, dtype, slots", _CASES)
def test_interpreted_matches_triton_kernel(b, t, h, k_dim, v_dim, chunk, k_part, dtype, slots):
  """Also with the interpreter's race detector (TMA copies against the CTA's accesses)."""
  args = _inputs(0, b, t, h, k_dim, v_dim, chunk, dtype)
  want = boundary_triton.boundary_states(*args, heads=h, chunk=chunk, block_v=16, k_part=16,
                                         num_warps=1, interpret=True)
  got = boundary_mosaic.boundary_states(
      *args, heads=h, chunk=chunk, k_part=k_part, slots=slots,
      interpret=plgpu.InterpretGPUParams(detect_races=True))
  _assert_close(got, want)
  assert not interpret_pallas_call.get_races().races_found


@pytest.mark.gpu
@pytest.mark.parametrize("b, t, h, k_dim, v_dim, chunk, k_part, dtype", [
    (2, 256, 3, 96, 192, 64, 32, jnp.bfloat16),
    (2, 256, 3, 96, 192, 64, 96, jnp.bfloat16),
    (4, 1024, 2, 16, 32, 64, 16, jnp.bfloat16),
    (1, 384, 2, 48, 48, 128, 48, jnp.bfloat16),
    (1, 192, 2, 48, 96, 32, 16, jnp.float32),
])
def test_compiled_matches_triton_kernel(b, t, h, k_dim, v_dim, chunk, k_part, dtype):
  args = _inputs(1, b, t, h, k_dim, v_dim, chunk, dtype)
  want = boundary_triton.boundary_states(*args, heads=h, chunk=chunk, block_v=16, k_part=16,
                                         num_warps=1, interpret=False)
  got = boundary_mosaic.boundary_states(*args, heads=h, chunk=chunk, k_part=k_part,
                                        interpret=False)
  _assert_close(got, want)


@pytest.mark.parametrize("b, t, h, k_dim, v_dim, chunk, k_part, dtype", [
    (4, 4096, 16, 96, 192, 64, 32, jnp.bfloat16),  # D760
    (64, 1024, 8, 16, 32, 64, 16, jnp.bfloat16),  # MQAR
    (4, 4096, 16, 48, 48, 64, 48, jnp.bfloat16),  # D170, one K-part
    (1, 256, 2, 32, 48, 16, 32, jnp.bfloat16),  # 4 chunks a block, a V-tile past V
    (1, 256, 2, 96, 192, 128, 32, jnp.bfloat16),
    (1, 256, 2, 48, 48, 32, 48, jnp.float32),
])
def test_lowers_for_cuda(b, t, h, k_dim, v_dim, chunk, k_part, dtype):
  bh = b * h
  sds = jax.ShapeDtypeStruct
  rows = lambda d: sds((b, t, h, d), dtype)
  f32 = lambda *shape: sds(shape, jnp.float32)
  args = (rows(k_dim), rows(v_dim), rows(v_dim), f32(bh, t), f32(bh, t // chunk),
          f32(bh, v_dim, k_dim), f32(bh, v_dim, k_dim))
  fn = functools.partial(boundary_mosaic.boundary_states, heads=h, chunk=chunk,
                         k_part=k_part, interpret=False)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "palimpsa_boundary_mosaic" in text


def test_rejects_tiles_it_does_not_take():
  args = _inputs(0, 1, 64, 1, 48, 16, 64, jnp.bfloat16)
  for chunk, k_part in ((64, 32), (64, 8), (8, 16)):
    with pytest.raises(ValueError, match=f"chunk={chunk}, k_part={k_part}"):
      boundary_mosaic.boundary_states(*args, heads=1, chunk=chunk, k_part=k_part,
                                      interpret=True)
  assert not boundary_mosaic.supported(128, 256, 256, jnp.float32, jnp.float32,
                                       interpret=False)

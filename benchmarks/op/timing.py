"""What the op's benchmarks share: their shapes, inputs, jitted calls, timing and floors.

    SHAPES[set][name] = (B, T, H, K, V); make_inputs(seed, shape, dtype) -> the op's 6 inputs
    time_queued(fn, arg_sets, warmup, iters) -> ms per call with the calls queued (device time)

The floors are docs/gpu_performance.md's: forward element-steps (B*T*H*K*V) / 4.2e12 s,
forward+backward element-steps / 1.2e12 s.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from palimpsa_jax.ops import palimpsa

# (B, T, H, K, V)
SHAPES = {
    "perf": {
        "D170": (4, 4096, 16, 48, 48),
        "M170": (4, 4096, 16, 48, 96),
        "D760": (4, 4096, 16, 96, 192),
        "MQAR": (64, 1024, 8, 16, 32),
        "D64": (4, 4096, 16, 64, 64),
        "D760p2": (4, 4096, 16, 128, 256),
        "P2700": (4, 4096, 20, 128, 256),  # 2.7B's heads
        "K128": (4, 4096, 16, 128, 128),
    },
    "small": {
        "tiny": (1, 256, 2, 16, 16),
        "tail": (2, 200, 2, 16, 32),
        "wide": (1, 128, 2, 32, 64),
    },
}
FWD_FLOOR_RATE = 4.2e12  # element-steps/s, reciprocal-bound (docs/gpu_performance.md)
FWD_BWD_FLOOR_RATE = 1.2e12


def make_inputs(seed, shape, dtype):
  """Benchmark inputs: q, k L2-normalised, alpha in (0.8, 1), beta in (0, 1), Ip in (0.5, 2)."""
  b, t, h, kd, vd = shape
  keys = jax.random.split(jax.random.key(seed), 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(keys[0], (b, t, h, kd)))
  k = unit(jax.random.normal(keys[1], (b, t, h, kd)))
  v = jax.random.normal(keys[2], (b, t, h, vd))
  beta = jax.nn.sigmoid(jax.random.normal(keys[3], (b, t, h, vd)))
  log_alpha = jnp.log(jax.random.uniform(keys[4], (b, t, h), minval=0.8, maxval=1.0))
  ip = jax.random.uniform(keys[5], (h,), minval=0.5, maxval=2.0)
  return tuple(x.astype(dtype) for x in (q, k, v, beta, log_alpha, ip))


def output_cotangent(shape):
  """The float32 cotangent [B, T, H, V] of the op's output that the fwd+bwd timings use."""
  return jax.random.normal(jax.random.key(99), shape[:3] + (shape[4],), jnp.float32)


def fwd_fn(impl, chunk_size, variance, op=palimpsa):
  """(out, [variance,] mu, precision) of `op` (palimpsa, or another version of it)."""
  @jax.jit
  def f(*args):
    r = op(*args, return_variance=variance, implementation=impl, chunk_size=chunk_size)
    return (r.out,) + ((r.variance,) if variance else ()) + (r.state.mu, r.state.precision)
  return f


def fwd_bwd_fn(impl, chunk_size, op=palimpsa):
  """(loss, gradients of the 6 inputs) of loss = sum(out * cot), out from `op`.

  The loss is returned so that the forward's readout is computed too: with jax.grad
  alone XLA drops it (the backward only needs the saved states).
  """
  @jax.jit
  def f(args, cot):
    def loss(*a):
      r = op(*a, implementation=impl, chunk_size=chunk_size)
      return jnp.sum(r.out.astype(jnp.float32) * cot)
    return jax.value_and_grad(loss, argnums=tuple(range(6)))(*args)
  return f


def rel_error(x, ref) -> float:
  """max |x - ref| / max |ref|, inf where that is not finite."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  err = float(np.max(np.abs(x - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
  return err if np.isfinite(err) else float("inf")


def poison(nbytes: int):
  """Fills and frees a NaN buffer so a following allocation likely reuses NaN memory."""
  jnp.full((max(nbytes // 4, 1),), jnp.nan, jnp.float32).block_until_ready()


def _warm_up(fn, arg_sets, calls) -> None:
  """Runs fn `calls` times over the rotating argument sets, blocking on each."""
  for i in range(calls):
    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))


def time_fn(fn, arg_sets, warmup, iters) -> float:
  """Median milliseconds of single calls of fn (each blocked on), rotating argument sets."""
  _warm_up(fn, arg_sets, warmup)
  times = []
  for i in range(iters):
    args = arg_sets[i % len(arg_sets)]
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def time_queued(fn, arg_sets, warmup, iters, batches=3) -> float:
  """Milliseconds per call of fn with `iters` calls queued back to back (median of batches).

  One block at the end of each batch, so the host's dispatch overlaps the device's work:
  this is the device time of a call, like triton.testing.do_bench's CUDA-event timing.
  """
  _warm_up(fn, arg_sets, warmup)
  per_call = []
  for _ in range(batches):
    start = time.perf_counter()
    jax.block_until_ready([fn(*arg_sets[i % len(arg_sets)]) for i in range(iters)])
    per_call.append((time.perf_counter() - start) / iters)
  return 1e3 * statistics.median(per_call)


def state_gib(shape, bytes_per=4) -> float:
  """GiB of T states [B, H, V, K] at shape (B, T, H, K, V)."""
  b, t, h, kd, vd = shape
  return b * t * h * kd * vd * bytes_per / 2**30


def temp_mib(fn, *args) -> float:
  """MiB of temporaries of jitted fn compiled for args; nan where the backend has no analysis."""
  stats = fn.lower(*args).compile().memory_analysis()
  return float("nan") if stats is None else stats.temp_size_in_bytes / 2**20

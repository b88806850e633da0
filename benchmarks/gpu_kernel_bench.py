"""Scratch timings of the palimpsa_gpu kernel: stages, tile variants, vs "chunked".

    PYTHONPATH=. python3 benchmarks/gpu_kernel_bench.py [--shapes D170 D760] [--sweep]

bf16 inputs (q, k L2-normalised, alpha in (0.8, 1)), float32 state; medians after warm-up
over rotating input sets. The official table is benchmarks/op_bench.py.
"""

import argparse
import dataclasses
import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels.palimpsa_gpu import op as gpu_op
from pallas_kernels.palimpsa_gpu import boundary, walk

SHAPES = {
    "D170": (4, 4096, 16, 48, 48),
    "M170": (4, 4096, 16, 48, 96),
    "D760": (4, 4096, 16, 96, 192),
    "MQAR": (64, 1024, 8, 16, 32),
}
REFERENCE_MS = {  # PERF.md: authors' Triton kernel fwd, fwd+bwd
    "D170": (6.76, 30.9), "M170": (7.44, 37.3), "D760": (28.6, 154.7),
    "MQAR": (1.32, 6.67)}
FWD_FLOOR_RATE, FWD_BWD_FLOOR_RATE = 4.2e12, 1.2e12


def make_inputs(seed, shape, dtype=jnp.bfloat16):
  b, t, h, k, v = shape
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, t, h, k))).astype(dtype)
  kk = unit(jax.random.normal(ks[1], (b, t, h, k))).astype(dtype)
  vv = jax.random.normal(ks[2], (b, t, h, v)).astype(dtype)
  beta = jax.random.uniform(ks[3], (b, t, h, v)).astype(dtype)
  la = jnp.log(jax.random.uniform(ks[4], (b, t, h), minval=0.8, maxval=1.0))
  ip = jnp.ones((h,), jnp.float32)
  mu0 = jnp.zeros((b, h, v, k), jnp.float32)
  p0 = jnp.ones((b, h, v, k), jnp.float32)
  cot = jax.random.normal(ks[5], (b, t, h, v), jnp.float32)
  return (q, kk, vv, beta, la, ip, mu0, p0), cot


def time_ms(fn, arg_sets, warmup=2, iters=10):
  for i in range(warmup):
    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
  times = []
  for i in range(iters):
    args = arg_sets[i % len(arg_sets)]
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def pallas_fns(cfg):
  def fwd(*a):
    return gpu_op._palimpsa(cfg, *a, None)[::2]  # out, mu_final

  def loss(a, cot):
    out = gpu_op._palimpsa(cfg, *a, None)[0]
    return jnp.sum(out.astype(jnp.float32) * cot)

  fb = jax.grad(loss)
  return jax.jit(fwd), jax.jit(lambda *a: fb(a[:-1], a[-1]))


def chunked_fns():
  from palimpsa_jax.ops import PalimpsaState, palimpsa

  def run(*a):
    q, k, v, beta, la, ip, mu0, p0 = a
    return palimpsa(q, k, v, beta, la, ip, initial_state=PalimpsaState(mu0, p0),
                    implementation="chunked", chunk_size=64)

  fwd = lambda *a: (lambda r: (r.out, r.state.mu))(run(*a))
  fb = jax.grad(lambda a, cot: jnp.sum(run(*a).out.astype(jnp.float32) * cot))
  return jax.jit(fwd), jax.jit(lambda *a: fb(a[:-1], a[-1]))


def _stage_inputs(cfg, args):
  q, k, v, beta, la, ip, mu0, p0 = args
  qh, kh, vh, betah, gates, ipv, ip_row = jax.jit(
      lambda *a: gpu_op._prepare(cfg, *a, None))(q, k, v, beta, la, ip)
  m0, b0 = gpu_op._initial_linear_state(cfg, mu0, p0, ipv)
  return qh, kh, vh, betah, gates, ip_row, m0, b0


def _boundary_fn(cfg):
  return jax.jit(functools.partial(
      boundary.boundary_states, chunk=cfg.chunk, block_v=cfg.block_v_boundary,
      num_warps=cfg.num_warps_boundary, interpret=False))


def _forward_walk_fn(cfg, dtype):
  return jax.jit(functools.partial(
      walk.walk_forward, chunk=cfg.chunk, block_v=cfg.block_v, unroll=cfg.unroll,
      with_var=False, out_dtype=dtype, num_warps=cfg.num_warps, interpret=False))


def _backward_walk_fn(cfg):
  fn = functools.partial(walk.walk_backward, dvar=None, chunk=cfg.chunk,
                         block_v=cfg.block_v_bwd, sub=cfg.sub, groups=cfg.groups_bwd,
                         num_warps=cfg.num_warps_bwd, interpret=False)
  return jax.jit(lambda *a: fn(*a[:7], m_starts=a[7], b_starts=a[8]))


def stage_times(cfg, args):
  """ms of (boundary, forward walk, backward walk), each jitted alone."""
  qh, kh, vh, betah, gates, ip_row, m0, b0 = _stage_inputs(cfg, args)
  bnd = _boundary_fn(cfg)
  ms, bs, _, _ = bnd(kh, vh, betah, gates.to_end, gates.chunk, m0, b0)
  do = jnp.ones(vh.shape, jnp.float32)
  return (time_ms(bnd, [(kh, vh, betah, gates.to_end, gates.chunk, m0, b0)]),
          time_ms(_forward_walk_fn(cfg, args[2].dtype),
                  [(qh, kh, vh, betah, gates.step, ip_row, ms, bs)]),
          time_ms(_backward_walk_fn(cfg),
                  [(qh, kh, vh, betah, gates.step, ip_row, do, ms, bs)]))


def _tiles(cfg, elements, v_min=1):
  kp = cfg.k + cfg.k_pad
  return gpu_op._block_v(cfg.v + cfg.v_pad, kp, elements, v_min)


def sweep(base, base_times, args, log):
  """Times tile variants of each stage alone; returns the config of the fastest."""
  qh, kh, vh, betah, gates, ip_row, m0, b0 = _stage_inputs(base, args)
  ms, bs, _, _ = _boundary_fn(base)(kh, vh, betah, gates.to_end, gates.chunk, m0, b0)
  do = jnp.ones(vh.shape, jnp.float32)
  best = {stage: (t, base) for stage, t in zip(("boundary", "walk_fwd", "walk_bwd"),
                                               base_times)}

  def trial(stage, label, cfg, fn, fn_args):
    try:
      t = time_ms(fn, [fn_args], warmup=1, iters=5)
    except Exception as e:  # A variant that does not compile is reported, not fatal.
      log(f"    {stage} {label}: failed {type(e).__name__}: {str(e)[:200]}")
      return
    log(f"    {stage} {label}: {t:.3f} ms")
    if stage not in best or t < best[stage][0]:
      best[stage] = (t, cfg)

  for elems, warps in ((2048, 4), (8192, 8)):
    cfg = dataclasses.replace(base, block_v_boundary=_tiles(base, elems, 16),
                              num_warps_boundary=warps)
    trial("boundary", f"bv={cfg.block_v_boundary} w={warps}", cfg, _boundary_fn(cfg),
          (kh, vh, betah, gates.to_end, gates.chunk, m0, b0))
  for elems, warps, unroll in ((2048, 4, 1), (2048, 4, 2), (1024, 2, 2), (1024, 1, 2),
                               (4096, 8, 2)):
    cfg = dataclasses.replace(base, block_v=_tiles(base, elems), num_warps=warps,
                              unroll=unroll)
    trial("walk_fwd", f"bv={cfg.block_v} w={warps} u={unroll}", cfg,
          _forward_walk_fn(cfg, args[2].dtype),
          (qh, kh, vh, betah, gates.step, ip_row, ms, bs))
  for elems, warps, sub, groups in ((512, 1, 4, 1), (512, 1, 4, 4), (256, 1, 8, 4),
                                    (512, 2, 4, 2), (1024, 2, 4, 2), (1024, 4, 4, 1)):
    bv = _tiles(base, elems)
    groups = math.gcd(groups, (base.v + base.v_pad) // bv)
    cfg = dataclasses.replace(base, block_v_bwd=bv, num_warps_bwd=warps, sub=sub,
                              groups_bwd=groups)
    trial("walk_bwd", f"bv={bv} w={warps} sub={sub} groups={groups}", cfg,
          _backward_walk_fn(cfg), (qh, kh, vh, betah, gates.step, ip_row, do, ms, bs))
  b_cfg, f_cfg, w_cfg = (best[s][1] for s in ("boundary", "walk_fwd", "walk_bwd"))
  return dataclasses.replace(
      base, block_v_boundary=b_cfg.block_v_boundary,
      num_warps_boundary=b_cfg.num_warps_boundary, block_v=f_cfg.block_v,
      num_warps=f_cfg.num_warps, unroll=f_cfg.unroll, block_v_bwd=w_cfg.block_v_bwd,
      num_warps_bwd=w_cfg.num_warps_bwd, sub=w_cfg.sub, groups_bwd=w_cfg.groups_bwd)


def max_rel_diff(xs, ys):
  return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
                   / jnp.max(jnp.abs(y.astype(jnp.float32)))) for x, y in zip(xs, ys))


def report(label, name, elem, tf, tfb, log):
  ref_f, ref_fb = REFERENCE_MS[name]
  log(f"  pallas_gpu[{label}]: fwd {tf:.3f} ms ({ref_f / tf:.1f}x ref, "
      f"{elem / FWD_FLOOR_RATE * 1e3 / tf:.2f} of floor) | fwd+bwd {tfb:.3f} ms "
      f"({ref_fb / tfb:.1f}x ref, {elem / FWD_BWD_FLOOR_RATE * 1e3 / tfb:.2f} of floor)")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
  parser.add_argument("--sweep", action="store_true")
  parser.add_argument("--no-chunked", action="store_true")
  args_ns = parser.parse_args()
  log = functools.partial(print, flush=True)
  log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
  for name in args_ns.shapes:
    shape = SHAPES[name]
    b, t, h, kd, vd = shape
    elem = b * t * h * kd * vd
    sets = [make_inputs(s, shape) for s in range(2)]
    fwd_sets = [s[0] for s in sets]
    fb_sets = [s[0] + (s[1],) for s in sets]
    base = gpu_op.make_config(sets[0][0][0], sets[0][0][2], sets[0][0][4],
                              sets[0][0][5], return_variance=False, chunk_size=64,
                              interpret=False)
    log(f"{name} {shape}: {base}")
    f, fb = pallas_fns(base)
    base_times = stage_times(base, sets[0][0])
    log("    stages (boundary, walk fwd, walk bwd) ms: "
        + ", ".join(f"{x:.3f}" for x in base_times))
    best = base
    if args_ns.sweep:
      best = sweep(base, base_times, sets[0][0], log)
      log(f"  best tiles: {best}")
    f2, fb2 = pallas_fns(best)
    fb2 = fb2.lower(*fb_sets[0]).compile()
    tf, tfb = time_ms(f2, fwd_sets), time_ms(fb2, fb_sets)
    report("best" if args_ns.sweep else "base", name, elem, tf, tfb, log)
    mem = fb2.memory_analysis()
    if mem is not None:
      log(f"    fwd+bwd compiled temp {mem.temp_size_in_bytes / 2**20:.1f} MiB, "
          f"args {mem.argument_size_in_bytes / 2**20:.1f} MiB")
    if args_ns.sweep:
      diff_out = max_rel_diff(f2(*fwd_sets[0]), f(*fwd_sets[0]))
      diff_grad = max_rel_diff(fb2(*fb_sets[0]), fb(*fb_sets[0]))
      log(f"    best vs base tiles: out/state max rel diff {diff_out:.1e}, grads "
          f"{diff_grad:.1e}")
    if not args_ns.no_chunked:
      f, fb = chunked_fns()
      tf = time_ms(f, fwd_sets, warmup=1, iters=3)
      tfb = time_ms(fb, fb_sets, warmup=1, iters=3)
      out_p = pallas_fns(base)[0](*fwd_sets[0])[0].astype(jnp.float32)
      out_c = f(*fwd_sets[0])[0].astype(jnp.float32)
      err = float(jnp.max(jnp.abs(out_p - out_c)) / jnp.max(jnp.abs(out_c)))
      log(f"  chunked: fwd {tf:.3f} ms | fwd+bwd {tfb:.3f} ms | max rel diff of out "
          f"pallas vs chunked {err:.1e}")


if __name__ == "__main__":
  main()

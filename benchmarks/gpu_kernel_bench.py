"""Tile tuning and per-stage timings of the palimpsa_gpu kernel (GPU only).

    python3 -m benchmarks.gpu_kernel_bench [--shapes D170 D760] [--sweep]

Times the kernel's three stages (boundary states, forward walk, backward walk) each jitted alone
and, with --sweep, tile variants of each stage, then the whole kernel with the chosen tiles.
Shapes, inputs (bf16 here), timing and the floor rates of docs/gpu_performance.md come from
benchmarks/op_bench.py, which is also the table that compares implementations. The table of
times per shape (and, with --sweep, the chosen tiles) goes as a record to --records
(benchmarks/records/).
"""

import argparse
import dataclasses
import functools
import itertools
import math
import sys

import jax
import jax.numpy as jnp

from benchmarks import results as results_lib
from benchmarks.op.timing import (FWD_BWD_FLOOR_RATE, FWD_FLOOR_RATE, SHAPES, make_inputs,
                                  time_queued)
from pallas_kernels.common import largest_power_of_two_dividing, next_power_of_two
from pallas_kernels.palimpsa_gpu import backward, forward, layout, make_config, palimpsa_gpu, stages
from pallas_kernels.palimpsa_gpu.boundary_mosaic import BoundaryMosaicTiles
from pallas_kernels.palimpsa_gpu.boundary_triton import BoundaryTritonTiles
from pallas_kernels.palimpsa_gpu.config import largest_block_v
from pallas_kernels.palimpsa_gpu.walk_backward_triton import WalkBackwardTritonTiles
from pallas_kernels.palimpsa_gpu.walk_forward_triton import WalkForwardTritonTiles, block_v_for

REFERENCE_MS = {  # docs/results/gpu_performance.md: authors' Triton kernel fwd, fwd+bwd
    "D170": (6.76, 30.9), "M170": (7.44, 37.3), "D760": (28.6, 154.7),
    "MQAR": (1.32, 6.67)}


def kernel_inputs(seed, shape, dtype=jnp.bfloat16):
  """op_bench inputs plus an initial state (mu 0, precision 1) and an output cotangent."""
  b, t, h, k, v = shape
  args = make_inputs(seed, shape, dtype)
  mu0 = jnp.zeros((b, h, v, k), jnp.float32)
  p0 = jnp.ones((b, h, v, k), jnp.float32)
  cot = jax.random.normal(jax.random.key(seed + 1000), (b, t, h, v), jnp.float32)
  return args + (mu0, p0), cot


def pallas_fns(cfg):
  kernel = functools.partial(palimpsa_gpu, return_variance=cfg.return_variance,
                             chunk_size=cfg.chunk, interpret=False, config=cfg)

  def fwd(*a):
    return kernel(*a, None)[::2]  # out, mu_final

  def loss(a, cot):
    out = kernel(*a, None)[0]
    return jnp.sum(out.astype(jnp.float32) * cot)

  fb = jax.grad(loss)
  return jax.jit(fwd), jax.jit(lambda *a: fb(a[:-1], a[-1]))


def _stage_args(cfg, args):
  """Each stage's inputs as the op passes them: (boundary, forward walk, backward walk)."""
  q, k, v, beta, la, ip, mu0, p0 = args
  gates = layout.make_gates(la, None, cfg.h, cfg.t_pad, cfg.chunk)
  ipv = jnp.tile(ip.astype(jnp.float32), cfg.b)
  m0, b0 = forward.initial_linear_state(cfg, mu0, p0, ipv, cfg.k_boundary)
  q_rows, k_rows = (layout.pad_rows(x, cfg.t_pad, cfg.k_pad) for x in (q, k))
  v_rows, beta_rows = (layout.pad_rows(x, cfg.t_pad, cfg.v_pad) for x in (v, beta))
  k_bound = layout.pad_rows(k, cfg.t_pad, cfg.k_boundary - cfg.k)
  bnd = (k_bound, v_rows, beta_rows, gates.to_end, gates.chunk, m0, b0)
  ms, bs, _, _ = _stage_fn("boundary", cfg)(*bnd)
  fwd = (q_rows, k_rows, v_rows, beta_rows, gates.step, ipv, ms, bs)
  rows = backward.walk_rows(cfg, q, k, v, beta, jnp.ones_like(v), None)
  bwd = (*rows[:4], gates.step, layout.ip_row(ipv, cfg.k_bwd), rows[4], None,
         backward.walk_starts(cfg, ms), backward.walk_starts(cfg, bs))
  return bnd, fwd, bwd


STAGES = ("boundary", "walk_fwd", "walk_bwd")
# The op's stage (stages.STAGES) behind each of STAGES.
_OP_STAGES = {"boundary": "boundary_fwd", "walk_fwd": "walk_fwd", "walk_bwd": "walk_bwd"}


def _stage_fn(stage, cfg):
  """The stage's kernel as cfg chooses it, jitted alone (the backward walk without the
  variance's cotangent)."""
  return jax.jit(functools.partial(stages.run, _OP_STAGES[stage], cfg))


def stage_times(cfg, args):
  """ms of (boundary, forward walk, backward walk), each jitted alone."""
  return tuple(time_queued(_stage_fn(stage, cfg), [stage_args], 2, 10)
               for stage, stage_args in zip(STAGES, _stage_args(cfg, args)))


def _tiles(cfg, elements, k_width, v_min=1):
  return largest_block_v(cfg.v + cfg.v_pad, k_width, elements, v_min)


def _variants(base):
  """(stage, label, config) of the tile variants the sweep times."""
  kp = base.k + base.k_pad
  kp2 = next_power_of_two(kp)
  largest = largest_power_of_two_dividing(kp)
  replace = dataclasses.replace
  out = []
  for k_part, (elems, warps) in itertools.product(
      sorted({16, min(largest, 32), min(kp2, 64)}), ((512, 1), (2048, 4))):
    tiles = BoundaryTritonTiles(k_part=k_part, block_v=_tiles(base, elems, k_part, 16),
                                num_warps=warps)
    out.append(("boundary", f"bv={tiles.block_v} w={warps} kpart={k_part}",
                replace(base, boundary_fwd=tiles)))
  if base.boundary_fwd.backend == "mosaic":
    for k_part in range(16, kp + 1, 16):
      if kp % k_part == 0:
        out.append(("boundary", f"mosaic kpart={k_part}",
                    replace(base, boundary_fwd=BoundaryMosaicTiles(k_part=k_part))))
  for k_part in sorted({8, 16, min(largest, 32)}):
    if k_part > largest:
      continue
    for warps in (1, 2):
      for unroll in (2, 4):
        bv = block_v_for(base.v + base.v_pad, k_part, warps)
        tiles = WalkForwardTritonTiles(k_part=k_part, block_v=bv, num_warps=warps,
                                       unroll=unroll)
        out.append(("walk_fwd", f"bv={bv} w={warps} u={unroll} kpart={k_part}",
                    replace(base, walk_fwd=tiles)))
  vp = base.v + base.v_pad
  # Backward walk (Triton): K in one program (padded to a power of two; at K=16 also in the
  # default tiles' 8-column parts), or in 16-column slices of one program each (the default
  # past K=16); one V-tile per program.
  k_layouts = {(kp2, 1), (16, kp // 16) if kp > 16 else (8, 1)}
  for k_part, k_split in sorted(k_layouts):
    tiles = (16, 32) if k_split > 1 else sorted({_tiles(base, 512, kp2),
                                                 _tiles(base, 1024, kp2)})
    for bv, sub, prefetch in itertools.product(tiles, (2, 4), (False, True)):
      if vp % bv:
        continue
      walk = WalkBackwardTritonTiles(k_part=k_part, k_split=k_split, block_v=bv,
                                     groups=vp // bv, sub=sub, num_warps=1, prefetch=prefetch)
      out.append(("walk_bwd", f"triton bv={bv} sub={sub} kpart={k_part} ksplit={k_split} "
                  f"prefetch={prefetch}", replace(base, walk_bwd=walk)))
  return out


def sweep(base, base_times, args, log):
  """Times tile variants of each stage alone; returns the config of the fastest."""
  best = {stage: (t, base) for stage, t in zip(STAGES, base_times)}
  for stage, label, cfg in _variants(base):
    stage_args = _stage_args(cfg, args)[STAGES.index(stage)]
    try:
      t = time_queued(_stage_fn(stage, cfg), [stage_args], warmup=1, iters=5)
    except Exception as e:  # A variant that does not compile is reported, not fatal.
      log(f"    {stage} {label}: failed {type(e).__name__}: {str(e)[:200]}")
      continue
    log(f"    {stage} {label}: {t:.3f} ms")
    if t < best[stage][0]:
      best[stage] = (t, cfg)
  return dataclasses.replace(base, **{
      _OP_STAGES[stage]: getattr(best[stage][1], _OP_STAGES[stage]) for stage in STAGES})


def max_rel_diff(xs, ys):
  return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
                   / jnp.max(jnp.abs(y.astype(jnp.float32)))) for x, y in zip(xs, ys))


def report(label, name, elem, tf, tfb, log):
  line = (f"  pallas_gpu[{label}]: fwd {tf:.3f} ms ({elem / FWD_FLOOR_RATE * 1e3 / tf:.2f} of "
          f"floor) | fwd+bwd {tfb:.3f} ms ({elem / FWD_BWD_FLOOR_RATE * 1e3 / tfb:.2f} of floor)")
  if name in REFERENCE_MS:
    ref_f, ref_fb = REFERENCE_MS[name]
    line += f" | vs authors' kernel: fwd {ref_f / tf:.1f}x, fwd+bwd {ref_fb / tfb:.1f}x"
  log(line)


TABLE_HEADER = ("| shape | (B, T, H, K, V) | boundary ms | walk fwd ms | walk bwd ms | fwd ms "
                "| fwd+bwd ms | fwd of floor | fwd+bwd of floor | x authors fwd / fwd+bwd "
                "| fwd+bwd temp MiB |\n|---|---|---|---|---|---|---|---|---|---|---|")


def table_row(name, shape, stage_ms, tf, tfb, temp_mib):
  """The record's row of one shape: the stages' ms (base tiles), the whole kernel's."""
  elem = math.prod(shape)
  ref = REFERENCE_MS.get(name)
  authors = f"{ref[0] / tf:.1f} / {ref[1] / tfb:.1f}" if ref else "-"
  return (f"| {name} | {tuple(shape)} | "
          + " | ".join(f"{x:.3f}" for x in stage_ms)
          + f" | {tf:.3f} | {tfb:.3f} | {elem / FWD_FLOOR_RATE * 1e3 / tf:.2f} "
          f"| {elem / FWD_BWD_FLOOR_RATE * 1e3 / tfb:.2f} | {authors} "
          f"| {'-' if temp_mib is None else f'{temp_mib:.1f}'} |")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--shapes", nargs="*", default=list(SHAPES["perf"]),
                      choices=list(SHAPES["perf"]))
  parser.add_argument("--sweep", action="store_true")
  results_lib.add_record_flags(parser)
  args_ns = parser.parse_args()
  rows, notes = [], []
  log = functools.partial(print, flush=True)
  log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
  for name in args_ns.shapes:
    shape = SHAPES["perf"][name]
    b, t, h, kd, vd = shape
    elem = b * t * h * kd * vd
    sets = [kernel_inputs(s, shape) for s in range(2)]
    fwd_sets = [s[0] for s in sets]
    fb_sets = [s[0] + (s[1],) for s in sets]
    base = make_config(sets[0][0][0], sets[0][0][2], sets[0][0][4], sets[0][0][5],
                       return_variance=False, chunk_size=64, interpret=False)
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
    tf, tfb = time_queued(f2, fwd_sets, 2, 10), time_queued(fb2, fb_sets, 2, 10)
    report("best" if args_ns.sweep else "base", name, elem, tf, tfb, log)
    mem = fb2.memory_analysis()
    if mem is not None:
      log(f"    fwd+bwd compiled temp {mem.temp_size_in_bytes / 2**20:.1f} MiB, "
          f"args {mem.argument_size_in_bytes / 2**20:.1f} MiB")
    rows.append(table_row(name, shape, base_times, tf, tfb,
                          None if mem is None else mem.temp_size_in_bytes / 2**20))
    notes.append(f"{name} {'best' if args_ns.sweep else 'base'} tiles: {best}")
    if args_ns.sweep:
      diff_out = max_rel_diff(f2(*fwd_sets[0]), f(*fwd_sets[0]))
      diff_grad = max_rel_diff(fb2(*fb_sets[0]), fb(*fb_sets[0]))
      log(f"    best vs base tiles: out/state max rel diff {diff_out:.1e}, grads "
          f"{diff_grad:.1e}")
  if not args_ns.no_record and rows:
    record = results_lib.make_record(
        "gpu_kernel_bench", f"gpu_kernel_bench {' '.join(args_ns.shapes)}"
        + (" (tile sweep)" if args_ns.sweep else ""),
        results_lib.command_line("benchmarks.gpu_kernel_bench", sys.argv[1:]),
        settings={"shapes": args_ns.shapes, "sweep": args_ns.sweep, "dtype": "bfloat16"},
        table="\n".join([TABLE_HEADER, *rows]),
        notes=["stages each jitted alone with the base tiles; fwd and fwd+bwd: the whole kernel "
               f"with the {'best' if args_ns.sweep else 'base'} tiles, 10 calls queued (median "
               "of 2 batches); floor: docs/gpu_performance.md; authors' times: "
               "docs/results/gpu_performance.md", *notes])
    log(f"wrote {results_lib.write_record(record, args_ns.records)}")


if __name__ == "__main__":
  main()

"""Tiles of an op's GPU kernels: each candidate checked and timed, in one process.

    python -m benchmarks.op.tuning                   # Fast Palimpsa, one H100: about 7 minutes
    python -m benchmarks.op.tuning --shapes small    # CPU, interpreted: a smoke run
    python -m benchmarks.op.tuning --op palimpsa --only D170 MQAR   # the exact kernel's stages
    python -m benchmarks.op.tuning --op palimpsa --shapes small     # CPU, interpreted

--op fast_palimpsa (the default): for every shape (op/timing.py's D760, D170, K128, MQAR) and chunk
(64 first, then 32 and 128), the op `fast_palimpsa(..., implementation="pallas_gpu")` runs
with each candidate tiling of its read kernels (pallas_kernels/fast_palimpsa_gpu/tiles.py)
that fits shared memory: first the forward tilings (forward timed), then the backward tilings
with the fastest forward (forward+backward timed). The last lines give the best tiles per
(chunk, Kp, Vp) as `reads.TUNED` entries.

--op palimpsa: the exact kernel (pallas_kernels/palimpsa_gpu) at op/timing.py's D170, M170, D760
and MQAR, chunk 64: for each of its three stages (boundary states, forward walk, backward
walk), the default tiles and each tile variant of that stage (Triton tiles; the Mosaic
boundary kernel's K-parts where it runs), the stage timed alone on the inputs the op passes
it (benchmarks/op/stages.py); then the whole forward+backward with the fastest tiles of
every stage against the default tiles. The last lines give the fastest tiles per shape, to
compare with what each stage module's `tiles` picks.

Both take bfloat16 inputs and check each candidate against the op's "chunked" implementation
on the same inputs (out; all six gradients where the candidate runs in the backward), not
against float64: a candidate off by more than --tol is marked WRONG and never picked; one
that fails to compile or run is marked FAILED. Timing is op/timing.py's `time_queued` (calls
queued, one block at the end: device time per call). The table lists every candidate,
fastest first per (shape, chunk, mode). --budget_s stops the run before the next candidate
once that many seconds have passed (compiles included) and records what was measured; the
record (benchmarks/results.py; benchmark fast_palimpsa_tuning or palimpsa_gpu_tuning) is
rewritten after every shape.
"""

import argparse
import dataclasses
import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import results as results_lib
from benchmarks.op import stages
from benchmarks.op.timing import SHAPES, make_inputs, rel_error, time_queued
from palimpsa_jax.ops import PalimpsaState, fast_palimpsa, palimpsa
from palimpsa_jax.ops.fast_palimpsa.gpu import fast_palimpsa_gpu
from pallas_kernels.common import largest_power_of_two_dividing, next_power_of_two, round_up
from pallas_kernels.fast_palimpsa_gpu import reads
from pallas_kernels.fast_palimpsa_gpu.tiles import BackwardTiles, ForwardTiles
from pallas_kernels.palimpsa_gpu import make_config, palimpsa_gpu
from pallas_kernels.palimpsa_gpu.boundary_mosaic import BoundaryMosaicTiles
from pallas_kernels.palimpsa_gpu.boundary_triton import BoundaryTritonTiles
from pallas_kernels.palimpsa_gpu.config import largest_block_v
from pallas_kernels.palimpsa_gpu.walk_backward_triton import WalkBackwardTritonTiles
from pallas_kernels.palimpsa_gpu.walk_forward_triton import WalkForwardTritonTiles, block_v_for

OPS = ("fast_palimpsa", "palimpsa")
# Fast Palimpsa's shapes and chunks per --shapes.
TUNED_SHAPES = {"perf": ("D760", "D170", "K128", "MQAR"), "small": ("tiny",)}
CHUNKS = {"perf": (64, 32, 128), "small": (64,)}
# The exact kernel's (one chunk: the op's default).
PALIMPSA_SHAPES = {"perf": ("D170", "M170", "D760", "MQAR"), "small": ("tiny",)}
PALIMPSA_CHUNKS = {"perf": (64,), "small": (64,)}
SMALL = {"tiny": (1, 64, 1, 16, 16)}


def forward_candidates(chunk: int, vp: int, small: bool) -> list[ForwardTiles]:
  """Forward tilings: V-blocks of one sub-tile of up to 64 or 128 columns, or one CTA over
  all of V in sub-tiles of up to 64."""
  if small:
    return [ForwardTiles(chunk, min(vp, 64))]
  subs = sorted({min(vp, 64), min(vp, 128)})
  tiles = [ForwardTiles(chunk, sub) for sub in subs]
  if vp > 64:
    tiles.append(ForwardTiles(chunk, 64, -(-vp // 64)))
  return tiles


def backward_candidates(chunk: int, vp: int, small: bool) -> list[BackwardTiles]:
  """Backward tilings: sub-tiles of 64 columns (or 128 where they cut V evenly) through
  rings of 1 or 2 slots."""
  if small:
    return [BackwardTiles(chunk, 64, 2)]
  subs = [64] + ([128] if vp % 128 == 0 else [])
  return [BackwardTiles(chunk, sub, slots) for sub in subs for slots in (1, 2)]


def _jitted(op, with_grads):
  """op jitted (its out), or with_grads: (args, cot) -> (loss, grads of the first six args)
  of sum(out * cot), jitted."""
  if not with_grads:
    return jax.jit(op)

  @jax.jit
  def loss_and_grads(args, cot):
    loss = lambda *a: jnp.sum(op(*a).astype(jnp.float32) * cot)
    return jax.value_and_grad(loss, argnums=tuple(range(6)))(*args)
  return loss_and_grads


def _runner(chunk, tiles, interpret, with_grads):
  """jitted (out) or (loss, grads of q, k, v, beta, log_alpha, prior) of the op's pallas_gpu
  with these read tiles; tiles None: the chunked implementation."""
  def op(q, k, v, beta, log_alpha, ip):
    if tiles is None:
      return fast_palimpsa(q, k, v, beta, log_alpha, ip, implementation="chunked",
                           chunk_size=chunk).out
    b, _, h, kd = q.shape
    vd = v.shape[-1]
    mu0 = jnp.zeros((b, h, vd, kd), jnp.float32)
    prec0 = jnp.broadcast_to(ip.astype(jnp.float32)[None, :, None, None], mu0.shape)
    return fast_palimpsa_gpu(q, k, v, beta, log_alpha, ip.astype(jnp.float32), mu0, prec0,
                             None, return_variance=False, chunk_size=chunk,
                             interpret=interpret, read_tiles=tiles)[0]

  return _jitted(op, with_grads)


def _error(got, want) -> float:
  return max(rel_error(np.asarray(g, np.float32), np.asarray(w, np.float32))
             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def measure(rows, where, label, check, timing, args, clock, log) -> float | None:
  """Checks one candidate (check(): its rel. error against chunked) and times it (timing():
  (function, argument sets)); appends its row to `rows` (where: shape name, dims, chunk and
  mode) and returns its ms, or None where it was not reached, failed or is wrong."""
  name, _, chunk, mode = where
  if clock() > args.budget_s:
    rows.append((*where, label, None, "not reached: --budget_s"))
    return None
  try:  # A candidate that fails to compile or run is reported, not fatal.
    err = check()
    if err < args.tol:
      fn, arg_sets = timing()
      ms = time_queued(fn, arg_sets, args.warmup, args.iters)
  except Exception as failure:  # pylint: disable=broad-except
    first_line = (str(failure).strip().splitlines() or [type(failure).__name__])[0]
    rows.append((*where, label, None, f"FAILED: {first_line[:120]}"))
    log(f"[{name} C={chunk}] {mode} {label}: FAILED: {first_line}")
    return None
  if not err < args.tol:
    rows.append((*where, label, None, f"WRONG: rel. error {err:.1e}"))
    log(f"[{name} C={chunk}] {mode} {label}: WRONG, rel. error {err:.1e}")
    return None
  log(f"[{name} C={chunk}] {mode} {label}: {ms:.3f} ms (rel. error {err:.1e})")
  rows.append((*where, label, ms, f"{err:.1e}"))
  return ms


def tune_shape(name, shape, chunk, args, clock, log):
  """Fast Palimpsa's rows (shape, dims, chunk, mode, tiles, ms or None, note) for one shape
  and chunk; stops before a candidate once clock() passes args.budget_s."""
  small = args.shapes == "small"
  interpret = jax.default_backend() not in ("gpu", "cuda")
  b, t, h, kd, vd = shape
  kp, vp = round_up(kd, 16), round_up(vd, 16)
  arg_sets = [make_inputs(s, shape, jnp.bfloat16) for s in range(args.rotate)]
  cot = jax.random.normal(jax.random.key(99), (b, t, h, vd), jnp.float32)
  fits = lambda tiles: _reason(arg_sets[0], chunk, tiles) is None
  first_backward = BackwardTiles(chunk, 64, 1)
  all_forwards = forward_candidates(chunk, vp, small)
  forwards = [f for f in all_forwards if fits((f, first_backward))]
  if not forwards:  # Every tiling declined: say why the first one was.
    return [(name, shape, chunk, "fwd", "-", None,
             "declined: " + _reason(arg_sets[0], chunk, (all_forwards[0], first_backward)))]
  log(f"[{name} C={chunk}] chunked reference")
  want_out = _runner(chunk, None, interpret, False)(*arg_sets[0])
  want_grads = _runner(chunk, None, interpret, True)(arg_sets[0], cot)[1]
  rows, best = [], {}
  for mode in ("fwd", "fwd+bwd"):
    if mode == "fwd":
      candidates = [(f, reads.default_tiles(chunk, kp, vp, False)[1]) for f in forwards]
    else:
      candidates = [(best["fwd"], bwd) for bwd in backward_candidates(chunk, vp, small)
                    if fits((best["fwd"], bwd))]
    timed = []
    for tiles in candidates:
      fn = _runner(chunk, tiles, interpret, mode == "fwd+bwd")
      if mode == "fwd":
        check = lambda fn=fn: _error(fn(*arg_sets[0]), want_out)
        timing = lambda fn=fn: (fn, [tuple(s) for s in arg_sets])
      else:
        check = lambda fn=fn: _error(fn(arg_sets[0], cot)[1], want_grads)
        timing = lambda fn=fn: (lambda *a: fn(a, cot), [tuple(s) for s in arg_sets])
      ms = measure(rows, (name, shape, chunk, mode), describe(tiles, mode), check, timing,
                   args, clock, log)
      if ms is not None:
        timed.append((ms, tiles))
    if not timed:
      break
    best[mode] = min(timed, key=lambda x: x[0])[1][0 if mode == "fwd" else 1]
  if "fwd+bwd" in best:
    rows.append((name, shape, chunk, "best", describe((best["fwd"], best["fwd+bwd"]), "both"),
                 None, tuned_entry(chunk, kp, vp, best["fwd"], best["fwd+bwd"])))
  return rows


def _reason(q_args, chunk, tiles) -> str | None:
  """Why the read kernels decline these tiles on the call's arrays (None: they take it)."""
  q, k, v, beta = q_args[:4]
  try:
    reads.reads_call(q, k, v, beta, chunk=chunk, with_var=False, interpret=False,
                     tiles=tiles)
  except NotImplementedError as declined:
    return str(declined)
  return None


def describe(tiles, mode) -> str:
  forward, backward = tiles
  fwd = f"fwd sub {forward.sub} x {forward.num_sub}"
  bwd = f"bwd sub {backward.sub}, {backward.slots} slot{'s' * (backward.slots > 1)}"
  return {"fwd": fwd, "fwd+bwd": bwd}.get(mode, f"{fwd}; {bwd}")


def tuned_entry(chunk, kp, vp, forward, backward) -> str:
  """The `reads.TUNED` line of a best tiling."""
  return (f"({chunk}, {kp}, {vp}): ({forward.sub}, {forward.num_sub}, {backward.sub}, "
          f"{backward.slots})")


def _block_v(cfg, elements, k_width, v_min=1):
  return largest_block_v(cfg.v + cfg.v_pad, k_width, elements, v_min)


def palimpsa_variants(base):
  """(stage of stages.STAGES, label, config) of the exact kernel's tile variants: each
  replaces the tiles of its stage only, by others than the default."""
  kp = base.k + base.k_pad
  kp2 = next_power_of_two(kp)
  largest = largest_power_of_two_dividing(kp)
  replace = dataclasses.replace
  out = []
  for k_part, (elems, warps) in itertools.product(
      sorted({16, min(largest, 32), min(kp2, 64)}), ((512, 1), (2048, 4))):
    tiles = BoundaryTritonTiles(k_part=k_part, block_v=_block_v(base, elems, k_part, 16),
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
    block_vs = (16, 32) if k_split > 1 else sorted({_block_v(base, 512, kp2),
                                                    _block_v(base, 1024, kp2)})
    for bv, sub, prefetch in itertools.product(block_vs, (2, 4), (False, True)):
      if vp % bv:
        continue
      walk = WalkBackwardTritonTiles(k_part=k_part, k_split=k_split, block_v=bv,
                                     groups=vp // bv, sub=sub, num_warps=1, prefetch=prefetch)
      out.append(("walk_bwd", f"triton bv={bv} sub={sub} kpart={k_part} ksplit={k_split} "
                  f"prefetch={prefetch}", replace(base, walk_bwd=walk)))
  return [variant for variant in out if variant[2] != base]  # The default is timed anyway.


def _palimpsa_runner(chunk, cfg, interpret, with_grads):
  """jitted (out) or (loss, grads of q, k, v, beta, log_alpha, prior) of the exact op from
  stages.kernel_inputs' arguments: palimpsa_gpu with cfg's tiles; cfg None: "chunked"."""
  def op(q, k, v, beta, log_alpha, ip, mu0, p0):
    if cfg is None:
      return palimpsa(q, k, v, beta, log_alpha, ip, initial_state=PalimpsaState(mu0, p0),
                      implementation="chunked", chunk_size=chunk).out
    return palimpsa_gpu(q, k, v, beta, log_alpha, ip, mu0, p0, None, return_variance=False,
                        chunk_size=chunk, interpret=interpret, config=cfg)[0]

  return _jitted(op, with_grads)


def describe_stages(cfg, base) -> str:
  """The tiles of each stage of cfg that differ from base's, or "the default tiles"."""
  changed = [f"{stage}: {getattr(cfg, op_stage)}"
             for stage, op_stage in stages.OP_STAGES.items()
             if getattr(cfg, op_stage) != getattr(base, op_stage)]
  return "; ".join(changed) or "the default tiles"


def tune_palimpsa_shape(name, shape, chunk, args, clock, log):
  """The exact kernel's rows (shape, dims, chunk, mode, tiles, ms or None, note) for one
  shape and chunk: each stage's variants timed alone (mode: the stage), then the whole
  forward+backward with the fastest of each stage and with the default tiles."""
  interpret = jax.default_backend() not in ("gpu", "cuda")
  b, t, h, kd, vd = shape
  arg_sets = [stages.kernel_inputs(s, shape)[0] for s in range(args.rotate)]
  cot = jax.random.normal(jax.random.key(99), (b, t, h, vd), jnp.float32)
  q, _, v, _, log_alpha, ip = arg_sets[0][:6]
  base = make_config(q, v, log_alpha, ip, return_variance=False, chunk_size=chunk,
                     interpret=interpret)
  log(f"[{name} C={chunk}] chunked reference; default tiles {base}")
  want_out = _palimpsa_runner(chunk, None, interpret, False)(*arg_sets[0])
  want_grads = _palimpsa_runner(chunk, None, interpret, True)(arg_sets[0], cot)[1]

  def check(cfg, with_grads):
    fn = _palimpsa_runner(chunk, cfg, interpret, with_grads)
    return (_error(fn(arg_sets[0], cot)[1], want_grads) if with_grads
            else _error(fn(*arg_sets[0]), want_out))

  rows, fastest = [], {}
  variants = palimpsa_variants(base)
  for index, stage in enumerate(stages.STAGES):
    op_stage = stages.OP_STAGES[stage]
    candidates = [(f"default {getattr(base, op_stage)}", base)]
    candidates += [(label, cfg) for s, label, cfg in variants if s == stage]
    timed = []
    for label, cfg in candidates:
      # The whole op checks the candidate (the backward for the backward walk's tiles); its
      # stage alone is timed.
      check_op = lambda cfg=cfg, grads=stage == "walk_bwd": check(cfg, grads)
      timing = lambda cfg=cfg, stage=stage, index=index: (
          stages.stage_fn(stage, cfg), [stages.stage_args(cfg, a)[index] for a in arg_sets])
      ms = measure(rows, (name, shape, chunk, stage), label, check_op, timing, args, clock,
                   log)
      if ms is not None:
        timed.append((ms, cfg))
    if timed:
      fastest[op_stage] = getattr(min(timed, key=lambda x: x[0])[1], op_stage)
  best = dataclasses.replace(base, **fastest)
  for label, cfg in [("default tiles", base)] + [("fastest tiles", best)] * (best != base):
    fn = _palimpsa_runner(chunk, cfg, interpret, True)
    measure(rows, (name, shape, chunk, "fwd+bwd"), label,
            lambda fn=fn: _error(fn(arg_sets[0], cot)[1], want_grads),
            lambda fn=fn: (lambda *a: fn(a, cot), [tuple(a) for a in arg_sets]),
            args, clock, log)
  rows.append((name, shape, chunk, "best", "fastest of each stage", None,
               describe_stages(best, base)))
  return rows


def format_table(rows) -> str:
  """Markdown: every candidate, fastest first within (shape, chunk, mode); modes in the
  order they were run."""
  lines = ["| shape | (B, T, H, K, V) | C | mode | tiles | ms | x fastest | rel. error vs chunked |",
           "|---|---|---|---|---|---|---|---|"]
  modes = list(dict.fromkeys(r[3] for r in rows))
  key = lambda r: (r[0], r[2], modes.index(r[3]), r[5] is None, r[5] or 0.0)
  for name, shape, chunk, mode, label, ms, note in sorted(rows, key=key):
    fastest = min((r[5] for r in rows if (r[0], r[2], r[3]) == (name, chunk, mode)
                   and r[5] is not None), default=None)
    ratio = "-" if ms is None else f"{ms / fastest:.2f}"
    lines.append(f"| {name} | {shape} | {chunk} | {mode} | {label} | "
                 f"{'-' if ms is None else f'{ms:.3f}'} | {ratio} | {note.replace('|', '/')} |")
  return "\n".join(lines)


def parse_args(argv):
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.splitlines()[0])
  parser.add_argument("--op", choices=OPS, default="fast_palimpsa",
                      help="fast_palimpsa: its read kernels' tilings; palimpsa: the exact "
                           "kernel's (palimpsa_gpu) tiles per stage")
  parser.add_argument("--shapes", choices=sorted(TUNED_SHAPES), default="perf",
                      help="perf: D760, D170, K128, MQAR (fast_palimpsa) or D170, M170, D760, "
                           "MQAR (palimpsa) on a GPU; small: one tiny shape, interpreted on CPU")
  parser.add_argument("--only", nargs="+", help="shapes of the set to tune (default all)")
  parser.add_argument("--chunks", type=results_lib.positive_ints,
                      help="comma-separated chunk sizes (default: fast_palimpsa 64,32,128, "
                           "small 64; palimpsa 64)")
  parser.add_argument("--budget_s", type=float, default=360.0,
                      help="stop before the next candidate after this many seconds")
  parser.add_argument("--iters", type=int, default=20, help="queued calls per timing batch")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--rotate", type=int, default=2, help="input sets timed in turn")
  parser.add_argument("--tol", type=float, default=3e-2,
                      help="largest rel. error against chunked (max |diff| / max |chunked|)")
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)
  names = (TUNED_SHAPES if args.op == "fast_palimpsa" else PALIMPSA_SHAPES)[args.shapes]
  for name in args.only or ():
    if name not in names:
      parser.error(f"--only {name}: not in --shapes {args.shapes} (its shapes: "
                   f"{', '.join(names)})")
  if min(args.iters, args.rotate) < 1 or args.warmup < 0 or args.budget_s <= 0:
    parser.error("--iters and --rotate must be >= 1, --warmup >= 0, --budget_s > 0")
  args.chunks = args.chunks or list(
      (CHUNKS if args.op == "fast_palimpsa" else PALIMPSA_CHUNKS)[args.shapes])
  bad = [c for c in args.chunks if c not in (16, 32, 64, 128)]
  if bad:
    parser.error(f"--chunks {bad}: the kernels take chunks of 16, 32, 64 or 128")
  args.names = args.only or names
  return args


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  start = time.perf_counter()
  clock = lambda: time.perf_counter() - start
  log = lambda msg: print(f"[{clock():7.1f} s] {msg}", file=sys.stderr, flush=True)
  shapes = SMALL if args.shapes == "small" else SHAPES["perf"]
  fast = args.op == "fast_palimpsa"
  tune = tune_shape if fast else tune_palimpsa_shape
  command = results_lib.command_line("benchmarks.op.tuning", argv)
  rows, path = [], None
  # Chunk-major: every shape at the default chunk before any other chunk.
  for chunk in args.chunks:
    for name in args.names:
      if clock() > args.budget_s:
        rows.append((name, shapes[name], chunk, "-", "-", None, "not reached: --budget_s"))
        continue
      rows += tune(name, shapes[name], chunk, args, clock, log)
      table = format_table(rows)
      if not args.no_record:
        record = results_lib.make_record(
            "fast_palimpsa_tuning" if fast else "palimpsa_gpu_tuning",
            "Fast Palimpsa read-kernel tiles, candidates timed" if fast
            else "palimpsa_gpu tiles per stage, candidates timed",
            command, table=table,
            settings=dict(op=args.op, shapes=args.shapes, only=list(args.names),
                          chunks=args.chunks, budget_s=args.budget_s, iters=args.iters,
                          rotate=args.rotate, dtype="bfloat16"),
            notes=[f"{clock():.0f} s so far",
                   "best rows: reads.TUNED entries" if fast else
                   "stage rows: the stage alone; fwd+bwd rows: the whole op; best rows: the "
                   "fastest tiles of each stage where they differ from the default"])
        path = results_lib.write_record(record, args.records, replace=path)
  print(format_table(rows))
  print("\nreads.TUNED entries (chunk, Kp, Vp): (fwd sub, fwd num_sub, bwd sub, bwd slots):"
        if fast else "\nthe fastest tiles of each stage, where they differ from the default:")
  for row in rows:
    if row[3] == "best":
      print(f"    {row[6]}," if fast else f"    {row[0]} C={row[2]}: {row[6]}")
  if path is not None:
    log(f"record: {path}")


if __name__ == "__main__":
  main()

"""Tiles of Fast Palimpsa's fused chunk-read kernels: each candidate timed, in one process.

    python -m benchmarks.op.tuning                   # one H100: about 7 minutes
    python -m benchmarks.op.tuning --shapes small    # CPU, interpreted: a smoke run

For every shape (op_bench's D760, D170, K128, MQAR; bfloat16 inputs) and chunk (64 first,
then 32 and 128), the op `fast_palimpsa(..., implementation="pallas_gpu")` runs with each
candidate tiling of its read kernels (pallas_kernels/fast_palimpsa_gpu/tiles.py) that fits
shared memory: first the forward tilings (forward timed), then the backward tilings with the
fastest forward (forward+backward timed). Each candidate is checked against the "chunked"
implementation on the same inputs (out; all six gradients), not against float64: a
candidate off by more than --tol is marked WRONG and never picked. Timing is op_bench's
`time_queued` (calls queued, one block at the end: device time per call).

The table lists every candidate, fastest first per (shape, chunk, mode); the last lines give
the best tiles per (chunk, Kp, Vp) as `reads.TUNED` entries. --budget_s stops the run before
the next candidate once that many seconds have passed (compiles included) and records what
was measured; the record (benchmarks/results.py) is rewritten after every shape.
"""

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import results as results_lib
from benchmarks.op_bench import SHAPES, make_inputs, rel_error, time_queued
from palimpsa_jax.ops import fast_palimpsa
from palimpsa_jax.ops.fast_palimpsa.gpu import fast_palimpsa_gpu
from pallas_kernels.common import round_up
from pallas_kernels.fast_palimpsa_gpu import reads
from pallas_kernels.fast_palimpsa_gpu.tiles import BackwardTiles, ForwardTiles

TUNED_SHAPES = {"perf": ("D760", "D170", "K128", "MQAR"), "small": ("tiny",)}
SMALL = {"tiny": (1, 64, 1, 16, 16)}
CHUNKS = {"perf": (64, 32, 128), "small": (64,)}


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

  if not with_grads:
    return jax.jit(op)

  @jax.jit
  def loss_and_grads(args, cot):
    loss = lambda *a: jnp.sum(op(*a).astype(jnp.float32) * cot)
    return jax.value_and_grad(loss, argnums=tuple(range(6)))(*args)
  return loss_and_grads


def _error(got, want) -> float:
  return max(rel_error(np.asarray(g, np.float32), np.asarray(w, np.float32))
             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def tune_shape(name, shape, chunk, args, clock, log):
  """Rows (shape, chunk, mode, tiles, ms or None, note) for one shape and chunk; stops
  before a candidate once clock() passes args.budget_s."""
  small = args.shapes == "small"
  interpret = jax.default_backend() not in ("gpu", "cuda")
  b, t, h, kd, vd = shape
  kp, vp = round_up(kd, 16), round_up(vd, 16)
  arg_sets = [make_inputs(s, shape, jnp.bfloat16) for s in range(args.rotate)]
  cot = jax.random.normal(jax.random.key(99), (b, t, h, vd), jnp.float32)
  fits = lambda tiles: _reason(arg_sets[0], chunk, tiles) is None
  forwards = [f for f in forward_candidates(chunk, vp, small)
              if fits((f, BackwardTiles(chunk, 64, 1)))]
  if not forwards:
    return [(name, shape, chunk, "fwd", "-", None,
             "declined: " + _reason(arg_sets[0], chunk, None))]
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
      label = describe(tiles, mode)
      if clock() > args.budget_s:
        rows.append((name, shape, chunk, mode, label, None, "not reached: --budget_s"))
        continue
      fn = _runner(chunk, tiles, interpret, mode == "fwd+bwd")
      call = fn if mode == "fwd" else (lambda *a, fn=fn: fn(a, cot))
      try:  # A candidate that fails to compile or run is reported, not fatal.
        err = (_error(fn(*arg_sets[0]), want_out) if mode == "fwd"
               else _error(fn(arg_sets[0], cot)[1], want_grads))
      except Exception as failure:  # pylint: disable=broad-except
        first_line = (str(failure).strip().splitlines() or [type(failure).__name__])[0]
        rows.append((name, shape, chunk, mode, label, None, f"FAILED: {first_line[:120]}"))
        log(f"[{name} C={chunk}] {mode} {label}: FAILED: {first_line}")
        continue
      if not err < args.tol:
        rows.append((name, shape, chunk, mode, label, None, f"WRONG: rel. error {err:.1e}"))
        log(f"[{name} C={chunk}] {mode} {label}: WRONG, rel. error {err:.1e}")
        continue
      ms = time_queued(call, [tuple(s) for s in arg_sets], args.warmup, args.iters)
      log(f"[{name} C={chunk}] {mode} {label}: {ms:.3f} ms (rel. error {err:.1e})")
      rows.append((name, shape, chunk, mode, label, ms, f"{err:.1e}"))
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


def format_table(rows) -> str:
  """Markdown: every candidate, fastest first within (shape, chunk, mode)."""
  lines = ["| shape | (B, T, H, K, V) | C | mode | tiles | ms | x fastest | rel. error vs chunked |",
           "|---|---|---|---|---|---|---|---|"]
  key = lambda r: (r[0], r[2], r[3] == "best", r[3], r[5] is None, r[5] or 0.0)
  for name, shape, chunk, mode, label, ms, note in sorted(rows, key=key):
    fastest = min((r[5] for r in rows if (r[0], r[2], r[3]) == (name, chunk, mode)
                   and r[5] is not None), default=None)
    ratio = "-" if ms is None else f"{ms / fastest:.2f}"
    lines.append(f"| {name} | {shape} | {chunk} | {mode} | {label} | "
                 f"{'-' if ms is None else f'{ms:.3f}'} | {ratio} | {note.replace('|', '/')} |")
  return "\n".join(lines)


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", choices=sorted(TUNED_SHAPES), default="perf",
                      help="perf: D760, D170, K128, MQAR (GPU); small: one tiny shape, "
                           "interpreted on CPU")
  parser.add_argument("--only", nargs="+", help="shapes of the set to tune (default all)")
  parser.add_argument("--chunks", type=results_lib.positive_ints,
                      help="comma-separated chunk sizes (default: 64,32,128; small: 64)")
  parser.add_argument("--budget_s", type=float, default=360.0,
                      help="stop before the next candidate after this many seconds")
  parser.add_argument("--iters", type=int, default=20, help="queued calls per timing batch")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--rotate", type=int, default=2, help="input sets timed in turn")
  parser.add_argument("--tol", type=float, default=3e-2,
                      help="largest rel. error against chunked (max |diff| / max |chunked|)")
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)
  names = TUNED_SHAPES[args.shapes]
  for name in args.only or ():
    if name not in names:
      parser.error(f"--only {name}: not in --shapes {args.shapes} (its shapes: "
                   f"{', '.join(names)})")
  if min(args.iters, args.rotate) < 1 or args.warmup < 0 or args.budget_s <= 0:
    parser.error("--iters and --rotate must be >= 1, --warmup >= 0, --budget_s > 0")
  args.chunks = args.chunks or list(CHUNKS[args.shapes])
  bad = [c for c in args.chunks if c not in (16, 32, 64, 128)]
  if bad:
    parser.error(f"--chunks {bad}: the kernels take chunks of 16, 32, 64 or 128")
  return args


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  start = time.perf_counter()
  clock = lambda: time.perf_counter() - start
  log = lambda msg: print(f"[{clock():7.1f} s] {msg}", file=sys.stderr, flush=True)
  shapes = SMALL if args.shapes == "small" else SHAPES["perf"]
  names = args.only or TUNED_SHAPES[args.shapes]
  command = results_lib.command_line("op.tuning", argv)
  rows, path = [], None
  # Chunk-major: every shape at the default chunk before any other chunk.
  for chunk in args.chunks:
    for name in names:
      if clock() > args.budget_s:
        rows.append((name, shapes[name], chunk, "fwd", "-", None, "not reached: --budget_s"))
        continue
      rows += tune_shape(name, shapes[name], chunk, args, clock, log)
      table = format_table(rows)
      if not args.no_record:
        record = results_lib.make_record(
            "fast_palimpsa_tuning", "Fast Palimpsa read-kernel tiles, candidates timed",
            command, table=table,
            settings=dict(shapes=args.shapes, only=list(names), chunks=args.chunks,
                          budget_s=args.budget_s, iters=args.iters, rotate=args.rotate,
                          dtype="bfloat16"),
            notes=[f"{clock():.0f} s so far", "best rows: reads.TUNED entries"])
        path = results_lib.write_record(record, args.records, replace=path)
  print(format_table(rows))
  print("\nreads.TUNED entries (chunk, Kp, Vp): (fwd sub, fwd num_sub, bwd sub, bwd slots):")
  for row in rows:
    if row[3] == "best":
      print(f"    {row[6]},")
  if path is not None:
    log(f"record: {path}")


if __name__ == "__main__":
  main()

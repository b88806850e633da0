"""How fast the Palimpsa op is: its implementations side by side, or one at several git refs.

    python -m benchmarks.op.bench --shapes small           # CPU: tiny shapes, a quick check
    python -m benchmarks.op.bench --shapes perf            # GPU/TPU: docs/gpu_performance.md's
    python -m benchmarks.op.bench --refs main . --shapes perf --only M170 D170 --iters 20
    python -m benchmarks.op.bench --refs HEAD . --shapes small --impls chunked   # CPU check

Side by side (the default), every implementation is first checked against the float64
sequential reference on the same inputs (outputs, variance, final state; gradients on the
first steps whose float64 backward fits in --max-ref-gib, all of them when it fits), after
poisoning the allocator with NaNs so a kernel that leaves elements unwritten fails. The
float64 references are most of a large shape's time: --ref_steps N checks outputs and
gradients on the first N steps only (the full-length outputs and gradients must still be
finite), and --ref_steps 0 skips the reference (rows say "unchecked"). Then, after warm-up,
over rotating input sets, two timings:
- "ms": per call, with --iters calls queued back to back and one block_until_ready at the end
  (median of 3 such batches). That is the device time of a call, gaps between its kernels
  included, without the host's dispatch and sync round trip; it is what triton's do_bench (the
  reference timings of docs/results/gpu_performance.md) measures with CUDA events, and what the
  ratios below use.
- "ms synced": the median of --iters single calls, each blocked on (adds the round trip).
  On CPU the host runs the calls itself: queuing gains nothing there and the two differ by noise.
The table gives both, element-steps/s (B*T*H*K*V per second), the speed-up over the best OTHER
implementation in the same run (>1: this one is faster) and the fraction of the floor
(timing.py) reached. `--impls ... fast_palimpsa fast_palimpsa_gpu` adds rows for Fast Palimpsa
(the rank-1 approximation, chunk = --chunk-size): its XLA matmul form and its GPU kernel,
checked against its own float64 reference instead, whose backward keeps more per step than the
exact op's (measured, so --max-ref-gib holds for it too). With --fla, FLA's rows (fla.py) join
the same table. A wrong or failed row makes the run exit non-zero. The record
(op_bench_DATE.json in benchmarks/records/, with the date, device, versions, git ref and the
exact command) is rewritten after every shape: a run stopped early keeps the shapes it measured
(its record says which it had not reached).

With --refs, one implementation (--impls NAME; default the platform's auto choice) is timed as
it is at each git ref. The same code's forward+backward time moves by up to 9% between
processes and machines (docs/gpu_kernel.md, "Measuring"), more than most kernel changes have to
tell apart; within one process it holds to a few tenths of a percent. So each ref's
palimpsa_jax and pallas_kernels are imported in turn (git_refs.py; "." is the working tree,
uncommitted changes included), that ref's op is compiled and run once, and its outputs and
gradients are compared with the first ref's. Then the refs are timed in --rounds interleaved
rounds (queued calls as above). The table gives every round, the median, the speed-up over the
first ref and the seconds of each ref's first call (its compilation, which dominates, plus one
call); the record is op_ab_DATE.json, with the refs' commits.
"""

import argparse
import functools
import importlib
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import results as results_lib
from benchmarks.op import fla, git_refs
from benchmarks.op.timing import (FWD_BWD_FLOOR_RATE, FWD_FLOOR_RATE, SHAPES, fwd_bwd_fn,
                                  fwd_fn, make_inputs, output_cotangent, poison, rel_error,
                                  state_gib, temp_mib, time_fn, time_queued)
from benchmarks.results import non_negative_int, positive_int
from palimpsa_jax.ops import fast_palimpsa, palimpsa
from palimpsa_jax.ops.fast_palimpsa import reference_fast_palimpsa
from palimpsa_jax.ops.palimpsa import reference_palimpsa
from palimpsa_jax.ops.palimpsa.api import auto_implementation

# The --impls names of Fast Palimpsa's rows (another op, checked against its own reference)
# and the fast_palimpsa implementation each runs.
FAST_IMPLS = {"fast_palimpsa": "chunked", "fast_palimpsa_gpu": "pallas_gpu"}
FAST = "fast_palimpsa"
MODES = ("fwd", "fwd+bwd")
# The records' benchmark names (benchmarks/render_records.py selects them): side by side, refs.
RECORD, REFS_RECORD = "op_bench", "op_ab"


def _fast_op(*args, implementation, **kwargs):
  """fast_palimpsa under this benchmark's calling convention; implementation: a FAST_IMPLS name."""
  return fast_palimpsa(*args, implementation=FAST_IMPLS[implementation], **kwargs)


def default_implementations() -> list[str]:
  """The XLA forms, and the default backend's kernel where it has one."""
  impls = ["sequential", "associative", "chunked"]
  kernel = auto_implementation()
  return impls if kernel in impls else impls + [kernel]


@functools.partial(jax.jit, static_argnames=("with_grads", "fast_chunk"))
def _reference(args, cot, with_grads, fast_chunk):
  def run(*a):
    r = (reference_palimpsa(*a) if fast_chunk is None
         else reference_fast_palimpsa(*a, chunk_size=fast_chunk))
    return jnp.sum(r.out * cot), (r.out, r.variance, r.state.mu, r.state.precision)
  if not with_grads:
    return run(*args)[1], None
  grads, res = jax.grad(run, argnums=tuple(range(6)), has_aux=True)(*args)
  return res, grads


def reference(args, cot, with_grads, fast_chunk=None):
  """float64 results (and grads) of reference_palimpsa, or of Fast Palimpsa's reference with
  chunk fast_chunk."""
  with jax.enable_x64(True):
    a64 = tuple(jnp.asarray(np.asarray(x.astype(jnp.float32)), jnp.float64) for x in args)
    res, grads = _reference(a64, jnp.asarray(np.asarray(cot), jnp.float64), with_grads,
                            fast_chunk)
    return jax.tree.map(np.asarray, (res, grads))


def reference_gib_per_step(shape, fast_chunk=None) -> float:
  """GiB that the float64 reference's backward keeps per step of T at this shape.

  The exact op's reference keeps about 4 states [B, H, V, K] per step. Fast Palimpsa's keeps
  several times that (the exact state, the chunk's start and own writes, the step's
  temporaries), so it is measured: the compiled temp memory of its backward at T = 2C minus
  that at T = C, over C steps (the part that does not grow with T cancels).
  """
  per_state = state_gib(shape[:1] + (1,) + shape[2:], 8)
  if fast_chunk is None:
    return 4 * per_state
  b, _, h, kd, vd = shape

  def temp_bytes(t):
    sds = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float64)
    args = (sds(b, t, h, kd),) * 2 + (sds(b, t, h, vd),) * 2 + (sds(b, t, h), sds(h))
    with jax.enable_x64(True):
      compiled = _reference.lower(args, sds(b, t, h, vd), with_grads=True,
                                  fast_chunk=fast_chunk).compile()
    stats = compiled.memory_analysis()
    return None if stats is None else stats.temp_size_in_bytes

  small, large = temp_bytes(fast_chunk), temp_bytes(2 * fast_chunk)
  if small is None or large is None:  # No memory analysis on this backend: a generous bound.
    return 32 * per_state
  return max(large - small, 0) / fast_chunk / 2**30


def reference_steps(shape, max_ref_gib, chunk_size, fast_chunk=None, cap=None) -> int:
  """Steps of T on which the float64 gradients are checked: all of them where the reference
  backward fits in max_ref_gib, else as many as fit (at least one chunk); at most `cap`."""
  if cap is not None and cap <= chunk_size:
    return min(shape[1], cap)
  per_step = reference_gib_per_step(shape, fast_chunk)
  fit = shape[1] if per_step == 0 else int(max_ref_gib // per_step)
  return int(min(shape[1], cap or shape[1], max(chunk_size, fit)))


def bench_shape(name, shape, impls, args, log):
  """Returns rows (shape, impl, mode, ms, error, temp_mib or nan) for one shape."""
  dtype = jnp.dtype(args.dtype)
  fwd_tol, grad_tol = (1e-5, 1e-4) if dtype == jnp.float32 else (2e-2, 2e-2)
  arg_sets = [make_inputs(s, shape, dtype) for s in range(args.rotate)]
  cot = output_cotangent(shape)
  # The float64 backward stores every state: check gradients on the first ref_t steps if
  # needed (each op's reference its own ref_t). --ref_steps caps the forward's check too.
  cap = getattr(args, "ref_steps", None)
  checked = cap != 0
  fwd_t = shape[1] if cap is None else min(shape[1], cap)
  refs = {}
  for fast_chunk in sorted({args.chunk_size if impl in FAST_IMPLS else None
                            for impl in impls}, key=str) if checked else ():
    ref_t = reference_steps(shape, args.max_ref_gib, args.chunk_size, fast_chunk, cap)
    trunc = tuple(x[:, :ref_t] if x.ndim >= 3 else x for x in arg_sets[0])
    log(f"[{name}] float64 reference{'' if fast_chunk is None else ' of fast_palimpsa'} "
        f"(outputs on the first {fwd_t} steps, gradients on the first {ref_t})")
    head = tuple(x[:, :fwd_t] if x.ndim >= 3 else x for x in arg_sets[0])
    ref_res, _ = reference(head, cot[:, :fwd_t], False, fast_chunk)
    if not args.variance:
      ref_res = ref_res[:1] + ref_res[2:]
    if fwd_t < shape[1]:  # A prefix: the outputs on it, not the final state, are comparable.
      ref_res = ref_res[:2 if args.variance else 1]
    refs[fast_chunk] = (ref_res, reference(trunc, cot[:, :ref_t], True, fast_chunk)[1], ref_t)
  rows = []
  for impl in impls:
    ref_res, ref_grads, ref_t = (refs[args.chunk_size if impl in FAST_IMPLS else None]
                                 if checked else (None, None, shape[1]))
    op = _fast_op if impl in FAST_IMPLS else palimpsa
    for mode in ("fwd", "fwd+bwd"):
      materialises = impl == "associative" or (impl == "sequential" and mode == "fwd+bwd")
      if materialises and 6 * state_gib(shape) > args.max_state_gib:
        rows.append((name, shape, impl, mode, None, None, "skipped: stores all T states",
                     None))
        continue
      def measure():  # called at once: this iteration's impl and mode
        fn = (fwd_fn(impl, args.chunk_size, args.variance, op) if mode == "fwd"
              else fwd_bwd_fn(impl, args.chunk_size, op))
        call = fn if mode == "fwd" else (lambda *a, fn=fn: fn(a, cot))
        poison(4 * shape[0] * shape[1] * shape[2] * shape[4])
        if not checked:
          full = jax.tree.leaves(call(*arg_sets[0]))
          ok = all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in full)
          err = 0.0 if ok else float("inf")
        elif mode == "fwd":
          got = jax.tree.map(np.asarray, call(*arg_sets[0]))
          prefix = lambda x: x[:, :fwd_t] if x.ndim == 4 and x.shape[1] == shape[1] else x
          err = max(rel_error(prefix(g), w) for g, w in zip(got, ref_res))
          ok = err < fwd_tol
        else:
          # The timed function itself, with the cotangent zero from ref_t on: outputs before
          # ref_t depend on inputs before it alone, so the gradients there are the truncated
          # problem's (and zero after it), with no second compile for a shorter T.
          got = jax.tree.map(np.asarray, fn(arg_sets[0], cot.at[:, ref_t:].set(0.0))[1])
          head = lambda x: x[:, :ref_t] if x.ndim >= 3 else x
          err = max(rel_error(head(g), w) for g, w in zip(got, ref_grads))
          tail = [np.asarray(g[:, ref_t:], np.float32) for g in got if g.ndim >= 3]
          ok = err < grad_tol and all(not np.any(x) for x in tail)
          if ref_t < shape[1]:  # the full-length gradients must at least be written and finite
            poison(4 * shape[0] * shape[1] * shape[2] * shape[4])
            full = jax.tree.leaves(call(*arg_sets[0]))
            ok = ok and all(np.all(np.isfinite(np.asarray(g, np.float32))) for g in full)
        t_checked = fwd_t if mode == "fwd" else ref_t
        tag = ("unchecked, finite" if not checked
               else "ref" if t_checked == shape[1] else f"ref, T={t_checked}")
        if not ok:
          what = "non-finite" if not checked else f"rel. error {err:.1e}"
          log(f"[{name}] {impl} {mode}: WRONG {what} ({tag})")
          return (name, shape, impl, mode, None, None, f"WRONG: {what} ({tag})", None)
        mem = None
        if args.memory:
          mem = (temp_mib(fn, *arg_sets[0]) if mode == "fwd"
                 else temp_mib(fn, arg_sets[0], cot))
        timed_sets = [tuple(s) for s in arg_sets]
        ms = time_queued(call, timed_sets, args.warmup, args.iters)
        ms_synced = time_fn(call, timed_sets, 0, args.iters)
        log(f"[{name}] {impl} {mode}: {ms:.3f} ms ({ms_synced:.3f} synced; err {err:.1e}, "
            f"{tag})")
        return (name, shape, impl, mode, ms, ms_synced, f"{err:.1e} ({tag})", mem)

      try:
        rows.append(measure())
      except Exception as error:  # pylint: disable=broad-except
        # One implementation that fails to lower, compile or run at a shape is a row of the
        # table; the other rows are still measured.
        what = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:120]}"
        log(f"[{name}] {impl} {mode}: FAILED {what}")
        rows.append((name, shape, impl, mode, None, None, f"FAILED: {what}", None))
  return rows


def format_table(rows, with_memory) -> str:
  """The markdown table of bench_shape's (and fla.rows') rows. "speed-up vs best
  other" compares the Palimpsa implementations; with FLA's rows, "x FLA Gated DeltaNet" is
  FLA's time over this row's (>1: this one is faster)."""
  with_fla = any(r[2] == "fla_gated_deltanet" and r[4] is not None for r in rows)
  header = ("| shape | (B, T, H, K, V) | implementation | mode | ms | ms synced | "
            "elem-steps/s | speed-up vs best other | fraction of floor | rel. error |")
  sep = "|---|---|---|---|---|---|---|---|---|---|"
  if with_fla:
    header += " x FLA Gated DeltaNet |"
    sep += "---|"
  if with_memory:
    header += " temp MiB |"
    sep += "---|"
  lines = [header, sep]
  for name, shape, impl, mode, ms, ms_synced, err, mem in rows:
    steps = float(np.prod(shape))
    is_fla = impl in fla.IMPLS
    if ms is None:
      cells = ["-", "-", "-", "-", "-", err]
    else:
      others = [r[4] for r in rows if r[0] == name and r[3] == mode and r[2] != impl
                and r[2] not in fla.IMPLS and r[4] is not None]
      ratio = f"{min(others) / ms:.2f}x" if others and not is_fla else "-"
      floor_ms = 1e3 * steps / (FWD_FLOOR_RATE if mode == "fwd" else FWD_BWD_FLOOR_RATE)
      synced = "-" if ms_synced is None else f"{ms_synced:.3f}"
      cells = [f"{ms:.3f}", synced, f"{steps / (ms * 1e-3):.2e}", ratio,
               "-" if is_fla else f"{floor_ms / ms:.3g}", err]
    if with_fla:
      gdn = [r[4] for r in rows if r[0] == name and r[3] == mode
             and r[2] == "fla_gated_deltanet" and r[4] is not None]
      cells.append(f"{gdn[0] / ms:.2f}x" if gdn and ms is not None and not is_fla else "-")
    line = f"| {name} | {shape} | {impl} | {mode} | " + " | ".join(cells) + " |"
    if with_memory:
      line += f" {'-' if mem is None else f'{mem:.1f}'} |"
    lines.append(line)
  return "\n".join(lines)


def compare_refs(args: argparse.Namespace, shapes: dict[str, tuple], commits: list[str],
                 log: Callable[[str], None]) -> list[dict[str, Any]]:
  """--refs: one row per (shape, mode, ref): round times, median, speed-up over the first ref,
  difference to its outputs and gradients, and the seconds of the first call (compile and one
  call). commits: what each ref names (git_refs.describe)."""
  impl = args.impls[0] if args.impls else auto_implementation()
  dtype = jnp.dtype(args.dtype)
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    roots = [git_refs.export(ref, pathlib.Path(tmp) / str(i)) for i, ref in enumerate(args.refs)]
    for name, shape in shapes.items():
      sets = [make_inputs(s, shape, dtype) for s in range(args.rotate)]
      cot = output_cotangent(shape)
      for mode in args.modes:
        calls = [tuple(s) for s in sets] if mode == "fwd" else [(s, cot) for s in sets]
        fns, outs, first_call_s = [], [], []
        for ref, root in zip(args.refs, roots):
          log(f"[{name} {mode}] {ref}: compiling")
          with git_refs.packages_from(root):
            ref_palimpsa = importlib.import_module("palimpsa_jax.ops").palimpsa
            fn = (fwd_fn(impl, args.chunk_size, False, op=ref_palimpsa) if mode == "fwd"
                  else fwd_bwd_fn(impl, args.chunk_size, op=ref_palimpsa))
            start = time.perf_counter()
            outs.append(jax.tree.map(np.asarray, fn(*calls[0])))
            first_call_s.append(time.perf_counter() - start)
          fns.append(fn)
        times = [[] for _ in fns]
        for round_ in range(args.rounds):
          for fn, ref_times in zip(fns, times):
            ref_times.append(time_queued(fn, calls, args.warmup, args.iters))
          log(f"[{name} {mode}] round {round_ + 1}/{args.rounds}: "
              + ", ".join(f"{t[-1]:.3f}" for t in times) + " ms")
        base = statistics.median(times[0])
        for ref, commit, ref_times, out, first_s in zip(args.refs, commits, times, outs,
                                                        first_call_s):
          median = statistics.median(ref_times)
          difference = max(rel_error(g, w) for g, w in zip(jax.tree.leaves(out),
                                                           jax.tree.leaves(outs[0])))
          rows.append(dict(shape=name, dims=shape, mode=mode, impl=impl, ref=ref,
                           commit=commit, ms=ref_times, median_ms=median,
                           speed_up=base / median, max_rel_difference=difference,
                           first_call_s=first_s))
  return rows


def format_refs_table(rows: list[dict[str, Any]]) -> str:
  """The markdown table of compare_refs' rows."""
  lines = ["| shape | (B, T, H, K, V) | mode | ref | commit | ms per round | median ms | "
           "x first ref | max rel. difference to first ref | first call s (compile) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    rounds = ", ".join(f"{t:.3f}" for t in r["ms"])
    lines.append(f"| {r['shape']} | {r['dims']} | {r['mode']} | {r['ref']} | {r['commit']} | "
                 f"{rounds} | {r['median_ms']:.3f} | {r['speed_up']:.4f} | "
                 f"{r['max_rel_difference']:.1e} | {r['first_call_s']:.1f} |")
  return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", choices=sorted(SHAPES), default="small")
  parser.add_argument("--only", nargs="*", help="shape names to run (default: all of the set)")
  parser.add_argument("--impls", nargs="*",
                      help="implementations (default: all for the platform; with --refs one, "
                      "default the platform's auto choice)")
  parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
  parser.add_argument("--chunk-size", type=positive_int, default=64)
  parser.add_argument("--warmup", type=non_negative_int, default=2)
  parser.add_argument("--iters", type=positive_int, default=10,
                      help="calls per timing (queued calls per batch)")
  parser.add_argument("--rotate", type=positive_int, default=3,
                      help="distinct input sets cycled through")
  parser.add_argument("--refs", nargs="+",
                      help="time one implementation as it is at these git refs, in one process "
                      "(the first is the baseline; '.' is the working tree)")
  parser.add_argument("--modes", nargs="+", choices=MODES,
                      help="with --refs: what is timed (default fwd+bwd)")
  parser.add_argument("--rounds", type=positive_int,
                      help="with --refs: interleaved timing rounds over the refs (default 3)")
  parser.add_argument("--memory", action="store_true", help="also report compiled temp memory")
  parser.add_argument("--variance", action="store_true",
                      help="forward also returns the variance (checked and timed)")
  parser.add_argument("--max-state-gib", type=float, default=16.0,
                      help="skip implementations that store every state beyond this")
  parser.add_argument("--max-ref-gib", type=float, default=16.0,
                      help="memory for the float64 reference backward (fewer steps if needed)")
  parser.add_argument("--ref_steps", type=non_negative_int, default=None,
                      help="check outputs and gradients against float64 on the first N steps "
                      "only (0: no float64 check, outputs only checked finite); default: "
                      "outputs on all steps, gradients on as many as fit --max-ref-gib")
  results_lib.add_record_flags(parser)
  parser.add_argument("--fla", nargs="*", choices=fla.IMPLS,
                      help="also time FLA's chunk Gated DeltaNet and SimpleGLA (torch, CUDA); "
                      "names choose among them (each costs a minute or two of Triton "
                      "autotuning per shape, unless TRITON_CACHE_DIR holds an earlier "
                      "run's tuning)")
  parser.add_argument("--note", default="", help="a line recorded with the results")
  args = parser.parse_args(argv)
  unknown = sorted(set(args.only or ()) - set(SHAPES[args.shapes]))
  if unknown:
    parser.error(f"--only {' '.join(unknown)}: not in --shapes {args.shapes} "
                 f"(its shapes: {', '.join(SHAPES[args.shapes])})")
  if args.refs is None:
    given = [flag for flag, value in (("--modes", args.modes), ("--rounds", args.rounds))
             if value is not None]
    if given:
      parser.error(f"{' and '.join(given)}: only with --refs")
    return args
  side_by_side = [flag for flag, given in (
      ("--fla", args.fla is not None), ("--memory", args.memory),
      ("--variance", args.variance), ("--ref_steps", args.ref_steps is not None)) if given]
  if side_by_side:
    parser.error(f"{', '.join(side_by_side)}: not with --refs (they belong to the side by "
                 "side comparison)")
  if len(args.refs) < 2:
    parser.error(f"--refs needs at least two refs to compare, got {args.refs}")
  if args.impls is not None and (len(args.impls) != 1 or args.impls[0] in FAST_IMPLS):
    parser.error(f"--impls with --refs: one implementation of the exact op, got {args.impls}")
  args.modes, args.rounds = args.modes or ["fwd+bwd"], args.rounds or 3
  return args


def main(argv: list[str] | None = None) -> list:
  """Runs the benchmark of argv (default sys.argv[1:]); returns its rows."""
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  shapes = {n: s for n, s in SHAPES[args.shapes].items() if not args.only or n in args.only}
  start = time.perf_counter()  # Each line says when it came: where a long run spends its time.
  log = lambda msg: print(f"[{time.perf_counter() - start:7.1f} s] {msg}", file=sys.stderr,
                          flush=True)
  device = jax.devices()[0]
  record_date = results_lib.utc_now()  # One record per run, dated when it began.
  log(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
  command = results_lib.command_line("benchmarks.op.bench", argv)
  if args.refs is not None:
    try:
      commits = [git_refs.describe(ref) for ref in args.refs]
    except ValueError as error:
      sys.exit(f"op bench: {error}")
    rows = compare_refs(args, shapes, commits, log)
    print(format_refs_table(rows))
    if not args.no_record:
      record = results_lib.make_record(
          REFS_RECORD, f"op bench at refs {' '.join(args.refs)}: {args.shapes} shapes, "
          f"{args.dtype} inputs, {rows[0]['impl']}", command, device=device.device_kind,
          table=format_refs_table(rows), date=record_date,
          settings={"shapes": args.shapes, "dtype": args.dtype, "chunk_size": args.chunk_size,
                    "refs": args.refs},
          notes=[f"chunk_size {args.chunk_size}; {args.rounds} interleaved rounds, each ref "
                 f"{args.iters} calls queued per batch after {args.warmup} warm-up calls "
                 f"(median of 3 batches), {args.rotate} rotating input sets; all refs in one "
                 "process"] + ([args.note] if args.note else []))
      log(f"wrote {results_lib.write_record(record, args.records)}")
    return rows

  impls = args.impls or default_implementations()
  rows, fla_notes, record_path = [], set(), None
  fla_versions = fla.versions() if args.fla is not None else None
  notes = [f"chunk_size {args.chunk_size}, {args.warmup} warm-up calls, {args.rotate} "
           f"rotating input sets, forward {'with' if args.variance else 'without'} variance, "
           + ("float64 checks on all steps (gradients as --max-ref-gib allows)"
              if args.ref_steps is None else "no float64 check" if args.ref_steps == 0
              else f"float64 checks on the first {args.ref_steps} steps"),
           f"ms: per call with {args.iters} calls queued and one block at the end (median "
           f"of 3 batches; device time per call, as triton's do_bench measures); ms synced: "
           f"median of {args.iters} single calls, each blocked on"]

  def save(not_reached: list[str]) -> None:
    """(Re)writes the run's one record with the rows so far; not_reached: what is left."""
    nonlocal record_path
    if args.no_record:
      return
    partial = ([f"partial: the run had not reached {', '.join(not_reached)} when this was "
                "written"] if not_reached else [])
    record = results_lib.make_record(
        RECORD, f"op bench {args.shapes} shapes, {args.dtype} inputs", command,
        device=device.device_kind, table=format_table(rows, args.memory), date=record_date,
        settings={"shapes": args.shapes, "dtype": args.dtype, "chunk_size": args.chunk_size},
        notes=notes + sorted(fla_notes) + ([args.note] if args.note else []) + partial,
        versions=fla_versions)
    record_path = results_lib.write_record(record, args.records, replace=record_path)

  for i, (name, shape) in enumerate(shapes.items()):
    log(f"shape {i + 1}/{len(shapes)}: {name} {shape}")
    rows += bench_shape(name, shape, impls, args, log)
    later = list(shapes)[i + 1:]
    if args.fla is not None:  # Saved before FLA's rows too: they take minutes per shape.
      save([f"FLA's rows of {name}"] + later)
      fla_rows, new_notes = fla.rows(name, shape, log, args.fla or fla.IMPLS)
      rows += fla_rows
      fla_notes.update(new_notes)
    save(later)
  print(format_table(rows, args.memory))
  if record_path is not None:
    log(f"wrote {record_path}")
  failed = [f"{r[0]} {r[2]} {r[3]}" for r in rows if str(r[6]).startswith(("WRONG", "FAILED"))]
  if failed:
    sys.exit(f"op bench: wrong or failed rows: {', '.join(failed)}")
  return rows


if __name__ == "__main__":
  main()

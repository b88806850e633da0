"""Times every Palimpsa implementation (forward and forward+backward) in one process.

    python -m benchmarks.op_bench --shapes small            # CPU: tiny shapes, a quick check
    python -m benchmarks.op_bench --shapes perf             # GPU/TPU: docs/gpu_performance.md's shapes

Every implementation is first checked against the float64 sequential reference on the same inputs
(outputs, variance, final state; gradients on the first steps whose float64 backward fits in
--max-ref-gib, all of them when it fits), after poisoning the allocator with NaNs so a kernel
that leaves elements unwritten fails. The float64 references are most of a large shape's time:
--ref_steps N checks outputs and gradients on the first N steps only (the full-length outputs and
gradients must still be finite), and --ref_steps 0 skips the reference (rows say "unchecked"). Then, after warm-up, over rotating input sets, two timings:
- "ms": per call, with --iters calls queued back to back and one block_until_ready at the end
  (median of 3 such batches). That is the device time of a call, gaps between its kernels
  included, without the host's dispatch and sync round trip; it is what triton's do_bench (the
  reference timings of docs/results/gpu_performance.md) measures with CUDA events, and what the
  ratios below use.
- "ms synced": the median of --iters single calls, each blocked on (adds the round trip).
  On CPU the host runs the calls itself: queuing gains nothing there and the two differ by noise.
The table gives both, element-steps/s (B*T*H*K*V per second), the speed-up over the best OTHER
implementation in the same run (>1: this one is faster) and the fraction of the floor
(docs/gpu_performance.md) reached (forward elem_steps / 4.2e12 s, forward+backward elem_steps / 1.2e12 s).
`--impls ... fast_palimpsa fast_palimpsa_gpu` adds rows for Fast Palimpsa (the rank-1
approximation, chunk = --chunk-size): its XLA matmul form and its GPU kernel, checked against
its own float64 reference instead, whose backward keeps more per step than the exact op's
(measured, so --max-ref-gib holds for it too). With --fla, FLA's rows join the same table.
A record with the date, device, versions, git ref and the exact command is written to
benchmarks/records/, and rewritten after every shape: a run stopped early keeps the shapes it
measured (its record says which it had not reached).
"""

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import fla_reference
from benchmarks import results as results_lib
from palimpsa_jax.ops import fast_palimpsa, palimpsa
from palimpsa_jax.ops.fast_palimpsa import reference_fast_palimpsa
from palimpsa_jax.ops.palimpsa import reference_palimpsa
from palimpsa_jax.ops.palimpsa.api import auto_implementation

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
INPUT_NAMES = ("q", "k", "v", "beta", "log_alpha", "prior_precision")
# The --impls names of Fast Palimpsa's rows (another op, checked against its own reference)
# and the fast_palimpsa implementation each runs.
FAST_IMPLS = {"fast_palimpsa": "chunked", "fast_palimpsa_gpu": "pallas_gpu"}
FAST = "fast_palimpsa"


def _fast_op(*args, implementation, **kwargs):
  """fast_palimpsa under op_bench's calling convention; implementation: a FAST_IMPLS name."""
  return fast_palimpsa(*args, implementation=FAST_IMPLS[implementation], **kwargs)


def default_implementations() -> list[str]:
  """The XLA forms, and the default backend's kernel where it has one."""
  impls = ["sequential", "associative", "chunked"]
  kernel = auto_implementation()
  return impls if kernel in impls else impls + [kernel]


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


def rel_error(x, ref) -> float:
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


def state_gib(shape, bytes_per=4) -> float:
  b, t, h, kd, vd = shape
  return b * t * h * kd * vd * bytes_per / 2**30


def temp_mib(fn, *args) -> float:
  stats = fn.lower(*args).compile().memory_analysis()
  return float("nan") if stats is None else stats.temp_size_in_bytes / 2**20


def bench_shape(name, shape, impls, args, log):
  """Returns rows (shape, impl, mode, ms, error, temp_mib or nan) for one shape."""
  dtype = jnp.dtype(args.dtype)
  fwd_tol, grad_tol = (1e-5, 1e-4) if dtype == jnp.float32 else (2e-2, 2e-2)
  arg_sets = [make_inputs(s, shape, dtype) for s in range(args.rotate)]
  cot = jax.random.normal(jax.random.key(99), shape[:3] + (shape[4],), jnp.float32)
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
  """The markdown table of bench_shape's (and fla_reference's) rows. "speed-up vs best
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
    fla = impl in fla_reference.IMPLS
    if ms is None:
      cells = ["-", "-", "-", "-", "-", err]
    else:
      others = [r[4] for r in rows if r[0] == name and r[3] == mode and r[2] != impl
                and r[2] not in fla_reference.IMPLS and r[4] is not None]
      ratio = f"{min(others) / ms:.2f}x" if others and not fla else "-"
      floor_ms = 1e3 * steps / (FWD_FLOOR_RATE if mode == "fwd" else FWD_BWD_FLOOR_RATE)
      synced = "-" if ms_synced is None else f"{ms_synced:.3f}"
      cells = [f"{ms:.3f}", synced, f"{steps / (ms * 1e-3):.2e}", ratio,
               "-" if fla else f"{floor_ms / ms:.3g}", err]
    if with_fla:
      gdn = [r[4] for r in rows if r[0] == name and r[3] == mode
             and r[2] == "fla_gated_deltanet" and r[4] is not None]
      cells.append(f"{gdn[0] / ms:.2f}x" if gdn and ms is not None and not fla else "-")
    line = f"| {name} | {shape} | {impl} | {mode} | " + " | ".join(cells) + " |"
    if with_memory:
      line += f" {'-' if mem is None else f'{mem:.1f}'} |"
    lines.append(line)
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", choices=sorted(SHAPES), default="small")
  parser.add_argument("--only", nargs="*", help="shape names to run (default: all of the set)")
  parser.add_argument("--impls", nargs="*", help="implementations (default: all for the platform)")
  parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
  parser.add_argument("--chunk-size", type=int, default=64)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--rotate", type=int, default=3, help="distinct input sets cycled through")
  parser.add_argument("--memory", action="store_true", help="also report compiled temp memory")
  parser.add_argument("--variance", action="store_true",
                      help="forward also returns the variance (checked and timed)")
  parser.add_argument("--max-state-gib", type=float, default=16.0,
                      help="skip implementations that store every state beyond this")
  parser.add_argument("--max-ref-gib", type=float, default=16.0,
                      help="memory for the float64 reference backward (fewer steps if needed)")
  parser.add_argument("--ref_steps", type=int, default=None,
                      help="check outputs and gradients against float64 on the first N steps "
                      "only (0: no float64 check, outputs only checked finite); default: "
                      "outputs on all steps, gradients on as many as fit --max-ref-gib")
  results_lib.add_record_flags(parser)
  parser.add_argument("--fla", nargs="*", choices=fla_reference.IMPLS,
                      help="also time FLA's chunk Gated DeltaNet and SimpleGLA (torch, CUDA); "
                      "names choose among them (each costs a minute or two of Triton "
                      "autotuning per shape, unless TRITON_CACHE_DIR holds an earlier "
                      "run's tuning)")
  parser.add_argument("--note", default="", help="a line recorded with the results")
  args = parser.parse_args()

  if args.ref_steps is not None and args.ref_steps < 0:
    parser.error(f"--ref_steps must be >= 0, got {args.ref_steps}")
  impls = args.impls or default_implementations()
  unknown = sorted(set(args.only or ()) - set(SHAPES[args.shapes]))
  if unknown:
    parser.error(f"--only {' '.join(unknown)}: not in --shapes {args.shapes} "
                 f"(its shapes: {', '.join(SHAPES[args.shapes])})")
  shapes = {n: s for n, s in SHAPES[args.shapes].items() if not args.only or n in args.only}
  start = time.perf_counter()  # Each line says when it came: where a long run spends its time.
  log = lambda msg: print(f"[{time.perf_counter() - start:7.1f} s] {msg}", file=sys.stderr,
                          flush=True)
  device = jax.devices()[0]
  record_date = results_lib.utc_now()  # One record per run, dated when it began.
  log(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
  rows, fla_notes, record_path = [], set(), None
  fla_versions = fla_reference.versions() if args.fla is not None else None
  command = results_lib.command_line("op_bench", sys.argv[1:])
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
        "op_bench", f"op_bench {args.shapes} shapes, {args.dtype} inputs", command,
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
      fla_rows, new_notes = fla_reference.rows(name, shape, log,
                                               args.fla or fla_reference.IMPLS)
      rows += fla_rows
      fla_notes.update(new_notes)
    save(later)
  print(format_table(rows, args.memory))
  if record_path is not None:
    log(f"wrote {record_path}")
  failed = [f"{r[0]} {r[2]} {r[3]}" for r in rows if str(r[6]).startswith(("WRONG", "FAILED"))]
  if failed:
    sys.exit(f"op_bench: wrong or failed rows: {', '.join(failed)}")

if __name__ == "__main__":
  main()

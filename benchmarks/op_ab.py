"""Times the Palimpsa op as it is at several git refs, in one process (an A/B of kernels).

    python -m benchmarks.op_ab --refs main . --only M170 D170     # GPU: main against the working tree
    python -m benchmarks.op_ab --refs HEAD~1 HEAD --shapes small --impl chunked   # CPU check

The same code's forward+backward time moves by up to 9% between processes and machines
(docs/gpu_kernel.md, "Measuring"), more than most kernel changes an A/B has to tell apart;
within one process it holds to a few tenths of a percent. So this script imports each ref's
palimpsa_jax and pallas_kernels in turn ("." is the working tree, uncommitted changes
included; other refs are exported with `git archive` into a temporary directory), compiles
and runs that ref's op once while its packages are the ones imported, and compares its
outputs and gradients with the first ref's. Then it times the refs in interleaved rounds
(op_bench.time_queued: calls queued back to back, median of 3 batches). The table gives
every round, the median, the speed-up over the first ref and the seconds of each ref's first
call (its compilation, which dominates, plus one call); it is written as a record to
benchmarks/records/ with the date, device, versions, the refs' commits and the command.
"""

import argparse
import contextlib
import importlib
import io
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import op_bench
from benchmarks import results as results_lib
from benchmarks.train_throughput import non_negative_int, positive_int
from palimpsa_jax.ops.palimpsa.api import auto_implementation

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("palimpsa_jax", "pallas_kernels")
MODES = ("fwd", "fwd+bwd")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--refs", nargs="+", required=True,
                      help="git refs to compare, the first is the baseline; '.' is the "
                           "working tree")
  parser.add_argument("--shapes", choices=sorted(op_bench.SHAPES), default="perf")
  parser.add_argument("--only", nargs="*", help="shape names of the set (default: all)")
  parser.add_argument("--impl", default="",
                      help="implementation (default: pallas_gpu on GPUs, pallas_tpu on "
                           "TPUs, else chunked)")
  parser.add_argument("--modes", nargs="+", default=["fwd+bwd"], choices=MODES)
  parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
  parser.add_argument("--chunk-size", type=positive_int, default=64)
  parser.add_argument("--rounds", type=positive_int, default=3,
                      help="interleaved timing rounds over the refs")
  parser.add_argument("--warmup", type=non_negative_int, default=2)
  parser.add_argument("--iters", type=positive_int, default=20, help="queued calls per batch")
  parser.add_argument("--rotate", type=positive_int, default=3,
                      help="distinct input sets cycled through")
  results_lib.add_record_flags(parser)
  parser.add_argument("--note", default="", help="a line recorded with the results")
  args = parser.parse_args(argv)
  if len(args.refs) < 2:
    parser.error(f"--refs needs at least two refs to compare, got {args.refs}")
  unknown = [n for n in args.only or () if n not in op_bench.SHAPES[args.shapes]]
  if unknown:
    parser.error(f"--only must name shapes of --shapes {args.shapes} "
                 f"({sorted(op_bench.SHAPES[args.shapes])}), got {unknown}")
  return args


def describe(ref: str) -> str:
  """The commit a ref names, or for '.' the working tree's HEAD and whether it has changes."""
  git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], check=True,
                                  capture_output=True, text=True).stdout.strip()
  if ref == ".":
    changed = git("status", "--porcelain", "--", *PACKAGES)
    return f"working tree ({git('rev-parse', '--short', 'HEAD')}{' + changes' if changed else ''})"
  try:
    return git("rev-parse", "--short", f"{ref}^{{commit}}")
  except subprocess.CalledProcessError as e:
    raise ValueError(f"--refs: {ref!r} is not a commit of {REPO}") from e


def export(ref: str, dest: pathlib.Path) -> pathlib.Path:
  """A directory holding the ref's packages: the repository for '.', else a git archive."""
  if ref == ".":
    return REPO
  archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref, *PACKAGES],
                           check=True, capture_output=True).stdout
  with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
    tar.extractall(dest, filter="data")
  return dest


@contextlib.contextmanager
def packages_from(root: pathlib.Path):
  """Inside the block, palimpsa_jax and pallas_kernels import from root; the modules
  imported before it are put back after it (a function built inside keeps working)."""
  saved = {n: m for n, m in sys.modules.items() if n.split(".")[0] in PACKAGES}
  for name in saved:
    del sys.modules[name]
  sys.path.insert(0, str(root))
  try:
    yield
  finally:
    sys.path.remove(str(root))
    for name in [n for n in sys.modules if n.split(".")[0] in PACKAGES]:
      del sys.modules[name]
    sys.modules.update(saved)


def max_rel_difference(got, want) -> float:
  return max(op_bench.rel_error(g, w) for g, w in zip(jax.tree.leaves(got),
                                                       jax.tree.leaves(want)))


def compare(args: argparse.Namespace, log: Callable[[str], None]) -> list[dict[str, Any]]:
  """One row per (shape, mode, ref): round times, median, speed-up, difference, and the
  seconds of the first call (compile and one call)."""
  impl = args.impl or auto_implementation()
  dtype = jnp.dtype(args.dtype)
  shapes = {n: s for n, s in op_bench.SHAPES[args.shapes].items()
            if not args.only or n in args.only}
  commits = [describe(ref) for ref in args.refs]
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    roots = [export(ref, pathlib.Path(tmp) / str(i)) for i, ref in enumerate(args.refs)]
    for name, shape in shapes.items():
      sets = [op_bench.make_inputs(s, shape, dtype) for s in range(args.rotate)]
      cot = jax.random.normal(jax.random.key(99), shape[:3] + (shape[4],), jnp.float32)
      for mode in args.modes:
        calls = [tuple(s) for s in sets] if mode == "fwd" else [(s, cot) for s in sets]
        fns, outs, first_call_s = [], [], []
        for ref, root in zip(args.refs, roots):
          log(f"[{name} {mode}] {ref}: compiling")
          with packages_from(root):
            palimpsa = importlib.import_module("palimpsa_jax.ops").palimpsa
            fn = (op_bench.fwd_fn(impl, args.chunk_size, False, op=palimpsa) if mode == "fwd"
                  else op_bench.fwd_bwd_fn(impl, args.chunk_size, op=palimpsa))
            start = time.perf_counter()
            outs.append(jax.tree.map(np.asarray, fn(*calls[0])))
            first_call_s.append(time.perf_counter() - start)
          fns.append(fn)
        times = [[] for _ in fns]
        for round_ in range(args.rounds):
          for fn, ref_times in zip(fns, times):
            ref_times.append(op_bench.time_queued(fn, calls, args.warmup, args.iters))
          log(f"[{name} {mode}] round {round_ + 1}/{args.rounds}: "
              + ", ".join(f"{t[-1]:.3f}" for t in times) + " ms")
        base = statistics.median(times[0])
        for ref, commit, ref_times, out, first_s in zip(args.refs, commits, times, outs,
                                                        first_call_s):
          median = statistics.median(ref_times)
          rows.append(dict(shape=name, dims=shape, mode=mode, impl=impl, ref=ref,
                           commit=commit, ms=ref_times, median_ms=median,
                           speed_up=base / median,
                           max_rel_difference=max_rel_difference(out, outs[0]),
                           first_call_s=first_s))
  return rows


def format_table(rows: list[dict[str, Any]]) -> str:
  lines = ["| shape | (B, T, H, K, V) | mode | ref | commit | ms per round | median ms | "
           "x first ref | max rel. difference to first ref | first call s (compile) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    rounds = ", ".join(f"{t:.3f}" for t in r["ms"])
    lines.append(f"| {r['shape']} | {r['dims']} | {r['mode']} | {r['ref']} | {r['commit']} | "
                 f"{rounds} | {r['median_ms']:.3f} | {r['speed_up']:.4f} | "
                 f"{r['max_rel_difference']:.1e} | {r['first_call_s']:.1f} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  args = parse_args(argv)
  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  device = jax.devices()[0]
  log(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
  rows = compare(args, log)
  table = format_table(rows)
  print(table)
  if not args.no_record:
    command = results_lib.command_line("op_ab", sys.argv[1:] if argv is None else argv)
    record = results_lib.make_record(
        "op_ab", f"op_ab {args.shapes} shapes, {args.dtype} inputs, {rows[0]['impl']}", command,
        device=device.device_kind, table=table,
        settings={"shapes": args.shapes, "dtype": args.dtype, "chunk_size": args.chunk_size,
                  "refs": args.refs},
        notes=[f"chunk_size {args.chunk_size}; {args.rounds} interleaved rounds, each ref "
               f"{args.iters} calls queued per batch after {args.warmup} warm-up calls (median "
               f"of 3 batches), {args.rotate} rotating input sets; all refs in one process"]
        + ([args.note] if args.note else []))
    log(f"wrote {results_lib.write_record(record, args.records)}")
  return rows


if __name__ == "__main__":
  main()

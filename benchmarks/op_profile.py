"""Where one Palimpsa op call's device time goes: per-kernel times from a profiler trace.

    python -m benchmarks.op_profile --shape D170                    # pallas_gpu, fwd and fwd+bwd
    python -m benchmarks.op_profile --shape MQAR --modes fwd --top 10 --output mqar.json
    python -m benchmarks.op_profile --shapes small --shape tiny --impl chunked   # CPU check

Compiles op_bench's forward (out, final state) or forward+backward (loss and the gradients
of the six inputs) for one shape on bf16 inputs, runs --warmup calls, then traces --calls
calls queued back to back with jax.profiler. Each kernel's time per call is listed with
its category, its HLO shape and the line of this project's code that launched it
(benchmarks/step_profile.py does the attribution). "device time" in the header is the sum
of kernel times per call; the wall time per call beside it includes the gaps between
kernels and the profiler's overhead. --output writes JSON; each mode's table and times go
as a record to --records (benchmarks/records/).
"""

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import results as results_lib
from benchmarks.op import timing as op_bench
from benchmarks.step import profile as step_profile
from benchmarks.results import non_negative_int, positive_int
from palimpsa_jax.ops.palimpsa import validation

MODES = ("fwd", "fwd+bwd")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", choices=sorted(op_bench.SHAPES), default="perf",
                      help="the op_bench shape set --shape is taken from")
  parser.add_argument("--shape", default="D170", help="a shape name of that set")
  parser.add_argument("--impl", default="pallas_gpu")
  parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
  parser.add_argument("--chunk-size", type=positive_int, default=64)
  parser.add_argument("--calls", type=positive_int, default=5, help="traced calls")
  parser.add_argument("--warmup", type=non_negative_int, default=3)
  parser.add_argument("--top", type=positive_int, default=25, help="kernels listed per table")
  parser.add_argument("--trace_dir", default="/tmp/palimpsa_op_profile")
  parser.add_argument("--output", default="", help="JSON file for the results")
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)
  if args.shape not in op_bench.SHAPES[args.shapes]:
    parser.error(f"--shape must be one of {sorted(op_bench.SHAPES[args.shapes])} "
                 f"(--shapes {args.shapes}), got {args.shape!r}")
  if args.impl not in validation.IMPLEMENTATIONS:
    parser.error(f"--impl must be one of {validation.IMPLEMENTATIONS}, got {args.impl!r}")
  return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  shape = op_bench.SHAPES[args.shapes][args.shape]
  inputs = op_bench.make_inputs(0, shape, jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(1), shape[:3] + (shape[4],), jnp.float32)
  device = jax.devices()[0]
  result = {"shape": args.shape, "dims": shape, "implementation": args.impl,
            "device": device.device_kind, "jax": jax.__version__,
            "command": results_lib.command_line("benchmarks.op_profile",
                                                 sys.argv[1:] if argv is None else argv),
            "modes": {}}
  for mode in args.modes:
    if mode == "fwd":
      call_args = inputs
      fn = op_bench.fwd_fn(args.impl, args.chunk_size, variance=False)
    else:
      call_args = (inputs, cot)
      fn = op_bench.fwd_bwd_fn(args.impl, args.chunk_size)
    compiled = fn.lower(*call_args).compile()
    for _ in range(args.warmup):
      jax.block_until_ready(compiled(*call_args))
    rows, wall_ms, _ = step_profile.trace_calls(
        lambda: compiled(*call_args), compiled, args.calls,
        f"{args.trace_dir}/{mode.replace('+', '_')}")
    table = step_profile.format_table(rows, args.top, wall_ms, unit="call")
    print(f"### {args.shape} {shape} {args.impl} {mode}, {device.device_kind}, "
          f"jax {jax.__version__}\n\n{table}\n", flush=True)
    result["modes"][mode] = {"wall_ms": wall_ms,
                             "kernels": [dataclasses.asdict(r) for r in rows]}
    if not args.no_record:
      record = step_profile.profile_record(
          "op_profile", f"op_profile {args.shape} {args.impl} {mode}", result["command"],
          rows=rows, top=args.top, wall_ms=wall_ms, unit="call",
          settings={"shapes": args.shapes, "shape": args.shape, "implementation": args.impl,
                    "mode": mode, "chunk_size": args.chunk_size, "dtype": "bfloat16"})
      print(f"wrote {results_lib.write_record(record, args.records)}", file=sys.stderr)
  if args.output:
    pathlib.Path(args.output).write_text(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()

"""The tied head's cross-entropy, value and gradients, in each implementation.

    python benchmarks/head_loss_bench.py                     # MQAR's paper shape, on the GPU
    python benchmarks/head_loss_bench.py --shape 4,64,64,512 --implementations unfused,xla \
        --no_record                                          # a CPU smoke run

For hidden states [B, T, d] and a table [vocab, d] (--shape B,T,d,vocab, float32 unless
--dtype), times the mean cross-entropy and its value and gradients for: `unfused` (the whole
float32 logits, then training.steps.cross_entropy_sums: what the models computed before
models/head_loss.py),
`xla` (head_loss's slices of positions) and `pallas_gpu` (head_loss's Pallas kernels), each
queued back to back (op_bench.time_queued) on rotating inputs, and checks each against
`unfused` (relative L2 error of the loss and both gradients) before timing. Prints a table with
each time's ratio to the fastest in this run; the record goes to --records.
"""

import argparse
import pathlib
import shlex
import sys
from typing import Any

import jax
import jax.numpy as jnp

if __package__ in (None, ""):  # Run as a script: the repository's packages.
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

# pylint: disable=wrong-import-position
from benchmarks import results as results_lib
from benchmarks.op_bench import time_queued
from palimpsa_jax.models import head_loss, language_model
from palimpsa_jax.training import steps as steps_lib
# pylint: enable=wrong-import-position

IMPLEMENTATIONS = ("unfused", "xla", "pallas_gpu")
MQAR_PAPER = (128, 128, 128, 8192)  # Query positions of a batch of 128, d_model 128.


def mean_loss(implementation: str):
  """(h, table, targets) -> the mean cross-entropy, computed by `implementation`."""
  if implementation == "unfused":  # The whole float32 logits, as evaluation computes them.
    return lambda h, table, targets: steps_lib.cross_entropy_sums(
        language_model.tied_head_logits(h, table), targets)[0] / targets.size
  return lambda h, table, targets: jnp.mean(head_loss.head_cross_entropy(
      h, table, targets, implementation=implementation)[0])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shape", type=results_lib.positive_ints,
                      default=list(MQAR_PAPER), help="B,T,d,vocab")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS),
                      help=f"comma-separated, from {IMPLEMENTATIONS}")
  parser.add_argument("--iters", type=int, default=20, help="calls queued per timing")
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)
  if len(args.shape) != 4:
    parser.error(f"--shape must be B,T,d,vocab, got {args.shape}")
  args.implementations = [i.strip() for i in args.implementations.split(",") if i.strip()]
  unknown = sorted(set(args.implementations) - set(IMPLEMENTATIONS))
  if unknown:
    parser.error(f"--implementations: unknown {unknown}; known: {IMPLEMENTATIONS}")
  return args


def inputs(shape, dtype, seed):
  batch, length, width, vocab = shape
  keys = jax.random.split(jax.random.key(seed), 3)
  h = jax.random.normal(keys[0], (batch, length, width)).astype(dtype)
  table = (width ** -0.5 * jax.random.normal(keys[1], (vocab, width))).astype(dtype)
  targets = jax.random.randint(keys[2], (batch, length), 0, vocab)
  return h, table, targets


def relative_error(x, ref) -> float:
  x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  arg_sets = [inputs(args.shape, dtype, seed) for seed in range(3)]
  reference = jax.jit(jax.value_and_grad(mean_loss("unfused"), argnums=(0, 1)))(*arg_sets[0])
  rows = []
  for name in args.implementations:
    forward = jax.jit(mean_loss(name))
    value_and_grads = jax.jit(jax.value_and_grad(mean_loss(name), argnums=(0, 1)))
    value, grads = value_and_grads(*arg_sets[0])
    errors = [relative_error(value, reference[0])] + [
        relative_error(g, r) for g, r in zip(grads, reference[1])]
    rows.append({"implementation": name, "errors": errors,
                 "forward_ms": time_queued(forward, arg_sets, 2, args.iters),
                 "forward_backward_ms": time_queued(value_and_grads, arg_sets, 2, args.iters)})
    print(f"{name}: forward {rows[-1]['forward_ms']:.3f} ms, forward+backward "
          f"{rows[-1]['forward_backward_ms']:.3f} ms", file=sys.stderr, flush=True)

  best = {key: min(r[key] for r in rows) for key in ("forward_ms", "forward_backward_ms")}
  lines = ["| implementation | forward ms | x fastest | fwd+bwd ms | x fastest "
           "| error: loss, dh, dtable |", "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {r['implementation']} | {r['forward_ms']:.3f} | "
        f"{r['forward_ms'] / best['forward_ms']:.2f} | {r['forward_backward_ms']:.3f} | "
        f"{r['forward_backward_ms'] / best['forward_backward_ms']:.2f} | "
        + ", ".join(f"{e:.1e}" for e in r["errors"]) + " |")
  table = "\n".join(lines)
  device = jax.devices()[0].device_kind
  batch, length, width, vocab = args.shape
  title = (f"head_loss_bench B={batch} T={length} d={width} vocab={vocab} {args.dtype}, "
           f"{device}")
  print(f"{title}, jax {jax.__version__}\n\n{table}")
  command = "python " + shlex.join(
      ["benchmarks/head_loss_bench.py"] + (sys.argv[1:] if argv is None else argv))
  if not args.no_record:
    record = results_lib.make_record(
        "head_loss_bench", title, command, table=table,
        settings={"shape": list(args.shape), "dtype": args.dtype},
        notes=["errors: relative L2 against the unfused loss of the same inputs; times: "
               f"{args.iters} calls queued back to back, median of 3 batches"])
    print(f"wrote {results_lib.write_record(record, args.records)}", file=sys.stderr)
  return {"rows": rows, "table": table}


if __name__ == "__main__":
  main()

"""The token loss (palimpsa_jax/ops/token_loss), value and gradients, in each implementation.

    python -m benchmarks.head_loss_bench                     # MQAR's paper shape, on the GPU
    python -m benchmarks.head_loss_bench --shape 4,64,64,512 --implementations logits,sliced \
        --no_record                                          # a CPU smoke run

For hidden states [B, T, d] and a table [vocab, d] (--shape B,T,d,vocab, float32 unless
--dtype), times the mean cross-entropy and its value and gradients for each implementation of
the op's table: `logits` (the whole float32 logits) and `sliced` (a slice of positions at a
time), each queued back to back (op_bench.time_queued) on rotating inputs, and checks each
against the op's float64 reference (relative L2 error of the loss and both gradients) before
timing. Prints a table with each time's ratio to the fastest in this run; the record goes to
--records.
"""

import argparse
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import results as results_lib
from benchmarks.op_bench import time_queued
from palimpsa_jax.ops.token_loss import token_loss
from palimpsa_jax.ops.token_loss.implementations import IMPLEMENTATIONS
from palimpsa_jax.ops.token_loss.reference import token_loss_reference

MQAR_PAPER = (128, 128, 128, 8192)  # Query positions of a batch of 128, d_model 128.


def mean_loss(implementation: str):
  """(h, table, targets) -> the mean cross-entropy, computed by `implementation`."""
  return lambda h, table, targets: token_loss(
      h, table, targets, implementation=implementation).nll.sum() / targets.size


def reference_value_and_grads(h, table, targets):
  """The float64 reference's mean cross-entropy and its gradients (h, table)."""
  with jax.enable_x64(True):
    h, table = (jnp.asarray(x, jnp.float64) for x in (h, table))
    mean = lambda h, table: token_loss_reference(
        h, table, targets, jnp.ones(targets.shape, jnp.float64)).nll.sum() / targets.size
    return jax.device_get(jax.jit(jax.value_and_grad(mean, argnums=(0, 1)))(h, table))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shape", type=results_lib.positive_ints,
                      default=list(MQAR_PAPER), help="B,T,d,vocab")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS),
                      help=f"comma-separated, from {tuple(IMPLEMENTATIONS)}")
  parser.add_argument("--iters", type=int, default=20, help="calls queued per timing")
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)
  if len(args.shape) != 4:
    parser.error(f"--shape must be B,T,d,vocab, got {args.shape}")
  args.implementations = [i.strip() for i in args.implementations.split(",") if i.strip()]
  unknown = sorted(set(args.implementations) - set(IMPLEMENTATIONS))
  if unknown:
    parser.error(f"--implementations: unknown {unknown}; known: {tuple(IMPLEMENTATIONS)}")
  return args


def inputs(shape, dtype, seed):
  batch, length, width, vocab = shape
  keys = jax.random.split(jax.random.key(seed), 3)
  h = jax.random.normal(keys[0], (batch, length, width)).astype(dtype)
  table = (width ** -0.5 * jax.random.normal(keys[1], (vocab, width))).astype(dtype)
  targets = jax.random.randint(keys[2], (batch, length), 0, vocab)
  return h, table, targets


def relative_error(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  arg_sets = [inputs(args.shape, dtype, seed) for seed in range(3)]
  reference = reference_value_and_grads(*arg_sets[0])
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
  command = results_lib.command_line(
      "head_loss_bench", sys.argv[1:] if argv is None else argv)
  if not args.no_record:
    record = results_lib.make_record(
        "head_loss_bench", title, command, table=table,
        settings={"shape": list(args.shape), "dtype": args.dtype},
        notes=["errors: relative L2 against the float64 reference on the same inputs; times: "
               f"{args.iters} calls queued back to back, median of 3 batches"])
    print(f"wrote {results_lib.write_record(record, args.records)}", file=sys.stderr)
  return {"rows": rows, "table": table}


if __name__ == "__main__":
  main()

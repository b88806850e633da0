"""How far Fast Palimpsa is from the exact op: relative error of the output and every gradient.

  python -m benchmarks.op.fast_palimpsa_error --checkpoint /tmp/fp_mqar

For chunk sizes 16, 32, 64 and four kinds of input, runs `fast_palimpsa` and `palimpsa` on the
same inputs and prints rel = ||approx - exact|| / ||exact|| (L2 over the whole array) for the
output and for the gradients of <out, cotangent> (a fixed Gaussian cotangent) w.r.t. q, k, v,
beta, log_alpha and prior_precision. Inputs:
  random:        q, k ~ N(0, 1/K); v ~ N(0, 1); beta ~ U(0, 1) per entry; alpha ~ U(0.6, 1);
  beta const V:  the same with beta_t[v] = beta_t[0] (the rank-1 form is then exact);
  beta k^2 const: beta constant over V and every |k_t[i]| equal (the increment beta_t k_t^2 is
                 constant over V and K);
  trained L<i>:  the op's inputs in layer i of a trained Palimpsa-D (--checkpoint: any train.py
                 workdir of a palimpsa_d model), on its task's data: MQAR test examples for an
                 MQAR run, uniformly random tokens otherwise.
The table and a record (date, device, versions, git ref, command) go to stdout and --records.
"""

import argparse
import sys
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import results as results_lib
from palimpsa_jax.data import mqar
from palimpsa_jax.layers import recurrent
from palimpsa_jax.models import registry
from palimpsa_jax.ops import fast_palimpsa, palimpsa
from palimpsa_jax.training import checkpoint as checkpoint_lib

INPUT_NAMES = ("q", "k", "v", "beta", "log_alpha", "prior_precision")
COLUMNS = ("out",) + tuple(f"d{n}" for n in INPUT_NAMES)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n\n")[0])
  parser.add_argument("--chunks", type=results_lib.positive_ints, default=[16, 32, 64],
                      help="chunk sizes (default 16,32,64)")
  parser.add_argument("--shape", type=results_lib.positive_ints, default=[2, 256, 4, 16, 16],
                      help="B,T,H,K,V of the synthetic inputs (default %(default)s)")
  parser.add_argument("--checkpoint", default=None,
                      help="a train.py workdir of a Palimpsa-D model: adds its layers' inputs")
  parser.add_argument("--batch", type=int, default=8,
                      help="sequences taken through the checkpoint's model (default 8)")
  parser.add_argument("--seed", type=int, default=0)
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)
  if len(args.shape) != 5:
    parser.error(f"--shape must be B,T,H,K,V (5 integers), got {args.shape}")
  return args


def synthetic_inputs(kind: str, shape, seed: int) -> dict[str, np.ndarray]:
  """Op inputs of one of the synthetic kinds (module docstring), float32 numpy."""
  b, t, h, kd, vd = shape
  rng = np.random.default_rng(seed)
  x = dict(q=rng.standard_normal((b, t, h, kd)) / np.sqrt(kd),
           k=rng.standard_normal((b, t, h, kd)) / np.sqrt(kd),
           v=rng.standard_normal((b, t, h, vd)), beta=rng.uniform(0.0, 1.0, (b, t, h, vd)),
           log_alpha=np.log(rng.uniform(0.6, 1.0, (b, t, h))),
           prior_precision=rng.uniform(0.5, 2.0, (h,)))
  if kind in ("beta const V", "beta k^2 const"):
    x["beta"] = np.broadcast_to(x["beta"][..., :1], x["beta"].shape)
  if kind == "beta k^2 const":
    x["k"] = np.sign(x["k"]) / np.sqrt(kd)
  return {n: np.asarray(a, np.float32) for n, a in x.items()}


def _tokens(config, batch: int, seed: int) -> np.ndarray:
  """[batch, seq_len] tokens of the run's task: MQAR test examples, else random tokens."""
  if config.task == "mqar":
    inputs, _ = mqar.multiquery_ar(config.data.vocab_size, batch, config.seq_len,
                                   config.data.num_kv_pairs, config.data.power_a,
                                   config.data.random_non_queries, seed=seed)
    return inputs
  rng = np.random.default_rng(seed)
  return rng.integers(0, config.model.vocab_size, (batch, config.seq_len))


def capture_layer_inputs(workdir: str, batch: int, seed: int) -> list[dict[str, np.ndarray]]:
  """The inputs each Palimpsa-D layer of a trained model hands to the op, per layer.

  Runs the model's blocks one by one, eagerly, with the layers' op calls (`palimpsa`, or
  `fast_palimpsa` in a precision="rank1" model) wrapped to record their arguments (what the
  layers compute is unchanged).
  """
  model, config, _ = checkpoint_lib.load_model(workdir)
  palimpsa_d = registry.MIXERS[registry.DEFAULT].kind
  if config.model.mixer != palimpsa_d:
    raise ValueError(f"--checkpoint must hold a {palimpsa_d} model, {workdir} holds "
                     f"{config.model.mixer!r}")
  model.eval()
  captured = []

  def recording(op):
    def run(q, k, v, beta, log_alpha, prior_precision, **kwargs):
      if beta is None:
        raise ValueError(f"--checkpoint {workdir}: a layer without metaplasticity (beta=None) "
                         "has nothing to approximate")
      captured.append({n: np.asarray(a, np.float32) for n, a in
                       zip(INPUT_NAMES, (q, k, v, beta, log_alpha, prior_precision))})
      return op(q, k, v, beta, log_alpha, prior_precision, **kwargs)
    return run

  h = model._embed(jnp.asarray(_tokens(config, batch, seed)))  # pylint: disable=protected-access
  with (unittest.mock.patch.object(recurrent, "palimpsa", recording(palimpsa)),
        unittest.mock.patch.object(recurrent, "fast_palimpsa", recording(fast_palimpsa))):
    for block in model.layer_blocks():
      h, _ = block(h, None, False)
  return captured


def _loss_and_grads(op, x, cotangent):
  def loss(*args):
    out = op(*args).out
    return jnp.sum(out * cotangent), out

  grads, out = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(
      *(jnp.asarray(x[n]) for n in INPUT_NAMES))
  return (out,) + grads


def relative_errors(x: dict[str, np.ndarray], chunk: int, seed: int) -> list[float]:
  """rel L2 error of fast_palimpsa against palimpsa: out, then the six gradients."""
  rng = np.random.default_rng(seed)
  cotangent = jnp.asarray(rng.standard_normal(x["v"].shape), jnp.float32)
  approx = jax.jit(lambda x, c: _loss_and_grads(
      lambda *a: fast_palimpsa(*a, chunk_size=chunk), x, c))(x, cotangent)
  exact = jax.jit(lambda x, c: _loss_and_grads(palimpsa, x, c))(x, cotangent)
  return [float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(e, np.float64))
                / max(np.linalg.norm(np.asarray(e, np.float64)), 1e-30))
          for a, e in zip(approx, exact)]


def format_table(rows) -> str:
  lines = ["| inputs | C | " + " | ".join(COLUMNS) + " |",
           "|---|---|" + "---|" * len(COLUMNS)]
  for inputs, chunk, errors in rows:
    lines.append(f"| {inputs} | {chunk} | " + " | ".join(f"{e:.2e}" for e in errors) + " |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
  """Measures every (inputs, chunk size) row; returns {"rows", "table"}."""
  args = parse_args(argv)
  argv_used = sys.argv[1:] if argv is None else argv
  command = results_lib.command_line("benchmarks.op.fast_palimpsa_error", argv_used)
  cases = [(kind, synthetic_inputs(kind, args.shape, args.seed))
           for kind in ("random", "beta const V", "beta k^2 const")]
  if args.checkpoint:
    layers = capture_layer_inputs(args.checkpoint, args.batch, args.seed)
    cases += [(f"trained L{i}", x) for i, x in enumerate(layers)]
  rows = []
  for name, x in cases:
    for chunk in args.chunks:
      rows.append((name, chunk, relative_errors(x, chunk, args.seed + 1)))
      print(f"{name} C={chunk}: out {rows[-1][2][0]:.2e}", file=sys.stderr, flush=True)
  table = format_table(rows)
  print(table)
  if not args.no_record:
    b, t, h, kd, vd = args.shape
    notes = [f"rel = ||fast_palimpsa - palimpsa||_2 / ||palimpsa||_2 over each array; grads of "
             f"<out, c> with c ~ N(0, 1); synthetic inputs B={b} T={t} H={h} K={kd} V={vd}, "
             f"float32"]
    if args.checkpoint:
      layer0 = cases[3][1]
      notes.append(f"trained: {args.batch} sequences through {args.checkpoint}, op inputs of "
                   f"shape {tuple(layer0['q'].shape)} q, {tuple(layer0['v'].shape)} v")
    record = results_lib.make_record(
        "fast_palimpsa_error", "Fast Palimpsa against the exact op: relative errors", command,
        table=table, notes=notes,
        settings={"chunks": args.chunks, "shape": args.shape, "checkpoint": args.checkpoint,
                  "seed": args.seed})
    print(f"wrote {results_lib.write_record(record, args.records)}", file=sys.stderr)
  return {"rows": rows, "table": table}


if __name__ == "__main__":
  main()

"""Bytes one block keeps for its backward, per token, for every mixer and size: traced on CPU.

    python -m benchmarks.step.activation_bytes                                  # every model, size
    python -m benchmarks.step.activation_bytes --models palimpsa_d --sizes 760m --precision rank1

For each model and size, one Block of the language model at batch x seq_len tokens is traced
(never compiled or run, so any size takes seconds on a CPU) and the arrays its backward keeps
are summed: without remat, and with remat under each config.remat_saves policy. The traced
program is the one a GPU runs: the Palimpsa mixers call the op's Pallas GPU kernels
(implementation="pallas_gpu"), the others their default XLA forms. Parameters are left out
(they stay in memory anyway); the bf16 copies of weights a block keeps are counted.

Columns: the bytes per token and layer without remat and under each policy; the float32
share without remat; and what all the layers keep without remat at batch x seq_len, in GiB
(docs/activation_memory.md, adds parameters and optimizer state to that).
"""

import argparse
import sys
import time

from benchmarks import results as results_lib
from palimpsa_jax import models
from palimpsa_jax.models import activation_memory
from palimpsa_jax.models import config as model_configs
from palimpsa_jax.models import registry
from palimpsa_jax.models.language_model import REMAT_SAVES

MODELS = tuple(registry.MIXERS)
SIZES = ("170m", "760m", "2.7b")


def block_config(model: str, size: str, precision: str = "exact"):
  """The model config at size, with the implementation a GPU runs (see the module doc)."""
  return activation_memory.gpu_program(models.model_config(model, size, precision=precision))


def saved_bytes(config, batch: int, seq_len: int, remat_saves: str | None = None) -> dict:
  """What one Block keeps for its backward (models/activation_memory.py, kept_bytes)."""
  return activation_memory.kept_bytes(config, batch, seq_len, remat_saves)


def measure(models_: list[str], sizes: list[str], precision: str, batch: int,
            seq_len: int) -> list[dict]:
  rows = []
  for size in sizes:
    for model in models_:
      config = block_config(model, size, precision)
      if precision != "exact" and not registry.kind(config).metaplastic:
        continue
      start = time.perf_counter()
      plain = saved_bytes(config, batch, seq_len)
      remat = {name: saved_bytes(config, batch, seq_len, name)["per_token"]
               for name in REMAT_SAVES}
      rows.append({"model": model, "size": size, "precision": precision,
                   "layers": config.num_layers, "no_remat": plain["per_token"],
                   "float32_share": plain["float32"] / plain["per_token"], **remat,
                   "all_layers_gib": plain["per_token"] * config.num_layers * batch * seq_len
                                     / 2**30,
                   "trace_s": time.perf_counter() - start})
  return rows


def render(rows: list[dict], batch: int, seq_len: int) -> str:
  kb = lambda x: f"{x / 1000:,.1f}"
  header = ("| model | size | precision | layers | no remat (KB) | f32 share | "
            + " | ".join(f"{name} (KB)" for name in REMAT_SAVES)
            + f" | all layers, no remat, {batch} x {seq_len} (GiB) |")
  lines = [header, "|" + "---|" * (header.count("|") - 1)]
  for r in rows:
    lines.append(f"| {r['model']} | {r['size']} | {r['precision']} | {r['layers']} "
                 f"| {kb(r['no_remat'])} | {r['float32_share']:.0%} | "
                 + " | ".join(kb(r[name]) for name in REMAT_SAVES)
                 + f" | {r['all_layers_gib']:.1f} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n")[0])
  parser.add_argument("--models", default=",".join(MODELS),
                      help="comma-separated model names (configs/lm.py's)")
  parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated sizes")
  parser.add_argument("--precision", default="exact", choices=("exact", "rank1"),
                      help="the metaplastic mixers' precision (rank1: Fast Palimpsa)")
  parser.add_argument("--batch", type=int, default=8, help="sequences per device")
  parser.add_argument("--seq_len", type=int, default=4096)
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)
  names = [m for m in args.models.split(",") if m]
  sizes = [s for s in args.sizes.split(",") if s]
  for name in names:
    if name not in model_configs.MODELS:
      parser.error(f"--models: {name!r} is not one of {', '.join(model_configs.MODELS)}")
  for size in sizes:
    if size not in model_configs.SIZES:
      parser.error(f"--sizes: {size!r} is not one of {', '.join(model_configs.SIZES)}")
  rows = measure(names, sizes, args.precision, args.batch, args.seq_len)
  table = render(rows, args.batch, args.seq_len)
  print(table)
  if not args.no_record:
    command = results_lib.command_line("benchmarks.step.activation_bytes",
                                       sys.argv[1:] if argv is None else argv)
    record = results_lib.make_record(
        "activation_bytes", "Bytes a block keeps for its backward, per token and layer",
        command, table=table,
        settings={"models": names, "sizes": sizes, "precision": args.precision,
                  "batch": args.batch, "seq_len": args.seq_len},
        notes=["Traced with jax's saved residuals (no compile): the GPU program "
               "(Palimpsa mixers on implementation='pallas_gpu'), parameters left out. "
               "KB = 1000 bytes."])
    print(f"wrote {results_lib.write_record(record, args.records)}", file=sys.stderr)
  return rows


if __name__ == "__main__":
  main()

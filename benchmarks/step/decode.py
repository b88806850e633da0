"""Decoding speed of Palimpsa-D against Transformer++: the path generate.py runs.

    python -m benchmarks.step.decode        # 170m, batch 1 and 64, prompts of 512 and 8192 tokens
    python -m benchmarks.step.decode --size tiny --batches 1,2 --prompt_lengths 16,32 --no_record

Each model is built at --size with random initial weights (bf16 compute, f32 parameters, the
default op implementation: the Pallas kernel on a GPU for Palimpsa-D's prefill). For every
batch and prompt length, models.decoding.stream decodes --new_tokens tokens after random prompt
tokens: the prompt is prefilled in chunks of decoding.PREFILL_CHUNK tokens, then one jitted
step per token (Palimpsa-D: the O(1) recurrent state; Transformer++: a KV cache of prompt +
new positions). One untimed pass compiles, then a timed pass records the time to the first
token (the prefill) and each later step (all rows; each step waits for its tokens on the host,
as streaming does); the decode rate is batch / the median step time. Results go to --output
(JSON, rewritten after each case so that a stopped run keeps what it measured), a bar chart to
--plot, and a record with date, device, versions, git ref and the exact command to --records.
"""

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from benchmarks import results as results_lib
from palimpsa_jax import models
from palimpsa_jax.models import decoding
from palimpsa_jax.models import registry

MODELS = (registry.DEFAULT, registry.ATTENTION)


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", default=",".join(MODELS),
                      help=f"comma-separated, from {models.config.MODELS}")
  parser.add_argument("--size", default="170m", choices=models.config.SIZES)
  parser.add_argument("--batches", type=results_lib.positive_ints, default=[1, 64])
  parser.add_argument("--prompt_lengths", type=results_lib.positive_ints, default=[512, 8192])
  parser.add_argument("--new_tokens", type=int, default=32,
                      help="new tokens per sequence (>= 2)")
  parser.add_argument("--output", default="", help="JSON file for the results")
  parser.add_argument("--plot", default="", help="PNG bar chart of the decode rates")
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)
  args.models = [m.strip() for m in args.models.split(",") if m.strip()]
  unknown = sorted(set(args.models) - set(models.config.MODELS))
  if unknown:
    parser.error(f"--models: unknown {unknown}; known: {models.config.MODELS}")
  if args.new_tokens < 2:
    parser.error(f"--new_tokens must be >= 2, got {args.new_tokens}")
  return args


def decode_once(model, prompt: np.ndarray, new_tokens: int) -> tuple[float, list[float]]:
  """(seconds to the first token, the seconds of each later step), greedy."""
  start = time.perf_counter()
  stamps = [time.perf_counter() for _ in decoding.stream(model, prompt, new_tokens,
                                                          temperature=0.0)]
  return stamps[0] - start, list(np.diff(stamps))


def bench_case(model, name: str, params: int, batch: int, prompt_length: int,
               new_tokens: int) -> dict[str, Any]:
  """One timed decode after a compiling one; the decode rate from the median step."""
  prompt = np.random.default_rng(0).integers(
      1, model.vocab_size, (batch, prompt_length)).astype(np.int32)
  compile_start = time.perf_counter()
  decode_once(model, prompt, new_tokens)  # Compiles (a no-op when already compiled).
  first_pass_s = time.perf_counter() - compile_start
  first_s, steps = decode_once(model, prompt, new_tokens)
  step_s = float(np.median(steps))
  return {"model": name, "params": params, "batch": batch, "prompt_length": prompt_length,
          "new_tokens": new_tokens, "first_pass_s": first_pass_s,
          "time_to_first_token_s": first_s,
          "prefill_tokens_per_s": batch * prompt_length / first_s,
          "step_s": steps, "decode_ms_per_step": 1e3 * step_s,
          "decode_tokens_per_s": batch / step_s}


def format_table(rows: list[dict[str, Any]]) -> str:
  lines = ["| model | params | batch | prompt | first token (s) | prefill tok/s | "
           "decode ms/step | decode tok/s |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['batch']} | "
                 f"{r['prompt_length']} | {r['time_to_first_token_s']:.3f} | "
                 f"{r['prefill_tokens_per_s']:,.0f} | {r['decode_ms_per_step']:.2f} | "
                 f"{r['decode_tokens_per_s']:,.0f} |")
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
  """Decode tokens/s per (batch, prompt length), one bar per model, log scale."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  cases = sorted({(r["batch"], r["prompt_length"]) for r in rows})
  names = list(dict.fromkeys(r["model"] for r in rows))
  width = 0.8 / len(names)
  fig, ax = plt.subplots(figsize=(1.6 * len(cases) + 2, 4))
  for i, name in enumerate(names):
    rate = {(r["batch"], r["prompt_length"]): r["decode_tokens_per_s"]
            for r in rows if r["model"] == name}
    ax.bar([c + i * width for c in range(len(cases))], [rate.get(c, 0) for c in cases],
           width, label=name)
  ax.set_xticks([c + width * (len(names) - 1) / 2 for c in range(len(cases))],
                [f"batch {b}\nprompt {t}" for b, t in cases])
  ax.set_yscale("log")
  ax.set_ylabel("decode tokens/s")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; returns {"rows", "table", "device", ...}."""
  args = parse_args(argv)
  device_kind = jax.devices()[0].device_kind
  argv_used = sys.argv[1:] if argv is None else argv
  command = results_lib.command_line("benchmarks.step.decode", argv_used)
  result = {"date": results_lib.utc_now(), "device": device_kind,
            "backend": jax.default_backend(), "jax": jax.__version__, "git": results_lib.git_ref(),
            "command": command, "size": args.size, "prefill_chunk": decoding.PREFILL_CHUNK,
            "rows": []}
  log(f"{device_kind} ({jax.default_backend()}), jax {jax.__version__}, git {result['git']}")
  for name in args.models:
    model = models.build_model(models.model_config(name, args.size), nnx.Rngs(0))
    model.eval()
    params = models.count_parameters(model)
    for batch in args.batches:
      for prompt_length in args.prompt_lengths:
        row = bench_case(model, name, params, batch, prompt_length, args.new_tokens)
        result["rows"].append(row)
        log(f"{name} batch {batch} prompt {prompt_length}: first token "
            f"{row['time_to_first_token_s']:.3f} s, decode {row['decode_tokens_per_s']:,.0f} "
            f"tokens/s ({row['decode_ms_per_step']:.2f} ms/step; first pass "
            f"{row['first_pass_s']:.1f} s)")
        if args.output:
          pathlib.Path(args.output).write_text(json.dumps(result, indent=2))
    del model
  result["table"] = format_table(result["rows"])
  print(result["table"])
  if args.output:
    pathlib.Path(args.output).write_text(json.dumps(result, indent=2))
    log(f"wrote {args.output}")
  if args.plot:
    plot(result["rows"], args.plot)
    log(f"wrote {args.plot}")
  if not args.no_record:
    record = results_lib.make_record(
        "decode_bench", f"decode_bench {args.size}, {args.new_tokens} new tokens", command,
        date=result["date"], device=device_kind, table=result["table"],
        settings={"size": args.size, "new_tokens": args.new_tokens},
        notes=[f"random initial weights, bf16 compute, greedy; models.decoding.stream "
               f"(generate.py's path): prefill in chunks of {decoding.PREFILL_CHUNK}, then one "
               f"jitted step per token with the tokens fetched to the host; timed pass after a "
               f"compiling pass; decode tok/s = batch / median step"])
    log(f"wrote {results_lib.write_record(record, args.records)}")
  return result


if __name__ == "__main__":
  main()

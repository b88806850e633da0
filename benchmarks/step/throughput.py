"""End-to-end training throughput of the paper's models (targets: docs/gpu_performance.md).

    python -m benchmarks.step.throughput                       # 4 models at 170m, 4 x 4096 tokens
    python -m benchmarks.step.throughput --compare_implementations pallas_gpu,chunked
    python -m benchmarks.step.throughput --mesh fsdp --num_devices 2
    python -m benchmarks.step.throughput --models palimpsa_d --context_parallel  # A/B
    python -m benchmarks.step.throughput --models palimpsa_d --size 760m --batch_size 8 --as_shipped

Each model is built from `models.model_config` (bf16 compute, f32 parameters)
and trained with the real LM recipe (configs/lm.py: AdamW, schedule, clipping,
weight-decay mask) through the jitted, state-donating train step of
palimpsa_jax/training, on one fixed batch of random tokens. Per model: the
train step is compiled ahead of time (compile seconds), run for --warmup_steps,
then timed twice over --steps steps: queued back to back with one block_until_ready
at the end, as the trainer runs them (it syncs only to log), which gives the step
time, tokens/s and MFU (6 * params * tokens/s over the devices' peak); and synced,
each step waited for, whose median, min and max show the host time a step spends
before the device is busy (synced minus queued). The table also gives
the compiled step's memory (temporaries; peak = arguments + outputs + temporaries
- donated buffers, per device) with the largest batch that memory suggests would
fit, and the step time relative to Mamba2's in the same run. --as_shipped builds each
model as configs/lm.py ships its size (its scan_layers, remat and remat_saves, which
--scan_layers, --remat and --remat_saves otherwise set). A step that does not fit the
device's memory gives an "out of memory" row and the run goes on; a non-finite loss or
gradient stops it. The JSON rows also count each Pallas kernel's launch sites in the
compiled step's HLO (a scanned layer's kernels appear once in its loop body). The table (with date, device, versions, git ref and the exact
command) is written as a record to benchmarks/records/, and --output writes JSON.
"""

import argparse
import collections
import contextlib
import importlib.util
import json
import pathlib
import re
import statistics
import sys
import time
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np

from benchmarks import results as results_lib
from benchmarks.results import non_negative_int, positive_int
from palimpsa_jax import models
from palimpsa_jax.models import registry
from palimpsa_jax.ops.gated_delta_rule import validation as gated_delta_validation
from palimpsa_jax.ops.palimpsa import validation as palimpsa_validation
from palimpsa_jax.training import compile_cache
from palimpsa_jax.training import metrics as metrics_lib
from palimpsa_jax.training import objective as objective_lib
from palimpsa_jax.training import optimizer as optimizer_lib
from palimpsa_jax.training import sharding as sharding_lib
from palimpsa_jax.training import state as state_lib
from palimpsa_jax.training import steps as steps_lib
from palimpsa_jax.training import trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]
LM_CONFIG = ROOT / "configs" / "lm.py"
PAPER_TOKENS = 15e9  # The paper's 170M pretraining run (docs/models.md, sizes and recipe).
MESHES = {"data": dict(data=-1, fsdp=1, tensor=1),
          "fsdp": dict(data=1, fsdp=-1, tensor=1),
          "sequence": dict(data=1, fsdp=1, sequence=-1, tensor=1)}


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n")[0])
  parser.add_argument("--models", default=",".join(registry.THROUGHPUT),
                      help=f"comma-separated names from {models.config.MODELS}")
  parser.add_argument("--size", default="170m", choices=models.config.SIZES)
  parser.add_argument("--seq_len", type=positive_int, default=4096)
  parser.add_argument("--batch_size", type=positive_int, default=4,
                      help="global batch in sequences")
  parser.add_argument("--device_batch", type=non_negative_int, default=0,
                      help="most sequences per device and microbatch (0: configs/lm.py's "
                           "default for the size); a smaller one accumulates gradients")
  parser.add_argument("--steps", type=positive_int, default=10, help="timed steps")
  parser.add_argument("--warmup_steps", type=non_negative_int, default=2)
  parser.add_argument("--implementation", default="auto",
                      help="op implementation of every model that accepts it "
                           f"(Palimpsa family: {palimpsa_validation.IMPLEMENTATIONS})")
  parser.add_argument("--compare_implementations", default="",
                      help="comma-separated implementations: Palimpsa-D once with each")
  parser.add_argument("--remat", action="store_true", help="rematerialise each block")
  parser.add_argument("--as_shipped", action="store_true",
                      help="scan_layers, remat and remat_saves as configs/lm.py ships the "
                           "size (instead of --scan_layers, --remat and --remat_saves)")
  parser.add_argument("--remat_saves", default="nothing",
                      choices=sorted(models.language_model.REMAT_SAVES),
                      help="what a rematerialised block keeps (model.remat_saves)")
  parser.add_argument("--precision", default="exact", choices=("exact", "rank1"),
                      help="the metaplastic mixers: the exact op or Fast Palimpsa "
                           "(docs/fast_palimpsa.md, chunk = the model's chunk_size)")
  parser.add_argument("--scan_layers", default="off", choices=("on", "off", "both"),
                      help="model.scan_layers: unrolled layers (off; configs/lm.py scans from "
                           "170m up), one scanned layer body (on), or each model both ways")
  parser.add_argument("--no_kernel_sharding", action="store_true",
                      help="trace the step outside training.sharding.kernel_context, so a "
                           "Pallas kernel computes the global batch on every device (A/B)")
  parser.add_argument("--context_parallel", action="store_true",
                      help="trace the step with the mesh's sequence axis in the kernel "
                           "context, so the mixers run context-parallel even where that "
                           "axis has size 1 (A/B of the path's overhead on one device)")
  parser.add_argument("--mesh", default="data", choices=sorted(MESHES),
                      help="batch split over the data axis, parameters sharded (FSDP), or "
                           "every sequence split over the devices (context parallelism)")
  parser.add_argument("--num_devices", type=int, default=0,
                      help="use the first N devices (0: all)")
  parser.add_argument("--output", default="",
                      help="JSON file for the results (rewritten after every model)")
  parser.add_argument("--compilation_cache_dir", default="",
                      help="JAX's persistent compilation cache (off by default: compile s "
                           "are then cold compiles)")
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)
  if args.as_shipped and (args.remat or args.remat_saves != "nothing"
                          or args.scan_layers != "off"):
    parser.error("--as_shipped takes scan_layers, remat and remat_saves from configs/lm.py: "
                 "give none of --scan_layers, --remat, --remat_saves with it")
  return args


def run_plan(args: argparse.Namespace) -> list[tuple[str, str, bool | None]]:
  """(model, implementation, scan_layers) triples in run order; scan_layers None: as
  configs/lm.py ships the size (--as_shipped)."""
  names = [m.strip() for m in args.models.split(",") if m.strip()]
  compare = [i.strip() for i in args.compare_implementations.split(",") if i.strip()]
  for impl in compare + [args.implementation]:
    if impl not in palimpsa_validation.IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of "
                       f"{palimpsa_validation.IMPLEMENTATIONS}, got {impl!r}")
  plan = []
  for name in names:
    if name not in models.config.MODELS:
      raise ValueError(f"--models: {name!r} is not one of {models.config.MODELS}")
    if name == registry.DEFAULT and compare:
      plan += [(name, impl) for impl in compare]
    else:
      plan.append((name, args.implementation))
  if compare and registry.DEFAULT not in names:
    plan += [(registry.DEFAULT, impl) for impl in compare]
  scans = ((None,) if args.as_shipped
           else {"on": (True,), "off": (False,), "both": (True, False)}[args.scan_layers])
  return [(name, impl, scan) for name, impl in plan for scan in scans]


def load_lm_config(model: str, args: argparse.Namespace) -> ml_collections.ConfigDict:
  """configs/lm.py for this model and size, with the benchmark's batch shape."""
  spec = importlib.util.spec_from_file_location("lm_config", LM_CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  device_batch = f",device_batch={args.device_batch}" if args.device_batch else ""
  return module.get_config(f"model={model},size={args.size},seq_len={args.seq_len},"
                           f"batch_size={args.batch_size}{device_batch}")


def model_implementation(model: str, requested: str) -> str:
  """The implementation set in the model config: the requested one where the model's op has
  it, else "auto" (attention has no op implementation; the other recurrent ops have the
  gated delta rule's XLA implementations, not the Palimpsa kernels)."""
  family = registry.KINDS[registry.mixer(model).kind]
  if "implementation" not in family.model_fields:
    return "auto"
  if not family.metaplastic and requested not in gated_delta_validation.IMPLEMENTATIONS:
    return "auto"
  return requested


def random_batch(args: argparse.Namespace, vocab_size: int,
                 mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
  """Random tokens and targets [B, T] int32, sharded over the batch axes."""
  rng = np.random.default_rng(0)
  shape = (args.batch_size, args.seq_len)
  local = {"tokens": rng.integers(0, vocab_size, shape, dtype=np.int32),
           "targets": rng.integers(0, vocab_size, shape, dtype=np.int32)}
  return sharding_lib.global_batch(local, mesh)


class BuiltStep(NamedTuple):
  """A compiled train step with its initial state and batch."""

  compiled: Any
  state: Any
  batch: dict[str, jax.Array]
  config: ml_collections.ConfigDict
  num_params: int
  grad_accum_steps: int
  init_s: float
  compile_s: float
  temp_gib: float | None
  peak_gib: float | None
  kernel_launches: dict[str, int] | None = None


def placement(args: argparse.Namespace,
              devices: list[jax.Device]) -> sharding_lib.MeshContext:
  """--mesh over `devices` with the default rules, and the kernel context the step is traced
  in (--context_parallel; none with --no_kernel_sharding)."""
  mesh_config = ml_collections.ConfigDict(dict(MESHES[args.mesh], rules=()))
  context = sharding_lib.mesh_context(mesh_config, devices,
                                      context_parallel=args.context_parallel)
  if args.no_kernel_sharding:
    context = context._replace(kernel_context=contextlib.nullcontext)
  return context


class StepParts(NamedTuple):
  """A train step before its state exists: config, state spec, jitted step, microbatches."""

  config: ml_collections.ConfigDict
  spec: Any
  train_step: Any
  grad_accum_steps: int


def train_step_parts(model: str, implementation: str, scan_layers: bool | None,
                     args: argparse.Namespace, where: sharding_lib.MeshContext) -> StepParts:
  """The model's config (configs/lm.py), state spec and jitted train step.

  scan_layers None (--as_shipped): scan_layers, remat and remat_saves as configs/lm.py ships
  the size; else those of the arguments.
  """
  config = load_lm_config(model, args)
  config.model.implementation = model_implementation(model, implementation)
  if scan_layers is not None:
    config.model.remat = args.remat
    config.model.remat_saves = args.remat_saves
    config.model.scan_layers = scan_layers
  if models.registry.KINDS[config.model.mixer].metaplastic:
    config.model.precision = args.precision
  mesh, rules = where.mesh, where.rules
  total_steps = config.total_steps
  spec = state_lib.make_train_state_spec(
      state_lib.run_model_fn(config), config.seed,
      trainer.make_tx_fn(config, total_steps), mesh, rules)
  schedule = optimizer_lib.learning_rate_schedule(config.optimizer, total_steps)
  accum = trainer.grad_accum_steps(config, sharding_lib.batch_shards(mesh))
  train_step = steps_lib.make_train_step(
      spec.parts.graphdef, spec.tx, schedule, objective_lib.Objective.for_run(config),
      spec.shardings, sharding_lib.replicated(mesh), accum, where.kernel_context)
  return StepParts(config, spec, train_step, accum)


def build_train_step(model: str, implementation: str, scan_layers: bool | None,
                     args: argparse.Namespace, where: sharding_lib.MeshContext,
                     label: str) -> BuiltStep:
  """Builds the model's state and batch and compiles its train step (train_step_parts)."""
  config, spec, train_step, accum = train_step_parts(model, implementation, scan_layers,
                                                     args, where)
  mesh = where.mesh
  num_params = int(sum(x.size for x in jax.tree.leaves(spec.abstract["params"])))

  start = time.perf_counter()
  state = spec.init()
  batch = random_batch(args, config.model.vocab_size, mesh)
  jax.block_until_ready((state, batch))
  init_s = time.perf_counter() - start
  log(f"{label} {num_params / 1e6:.1f}M params, {config.model.num_layers} layers: "
      f"initialised in {init_s:.1f} s, compiling the train step ...")
  start = time.perf_counter()
  compiled = train_step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  temp_gib = getattr(memory, "temp_size_in_bytes", 0) / 2**30 if memory else None
  peak_gib = None
  if memory is not None:
    peak_gib = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                + memory.temp_size_in_bytes - memory.alias_size_in_bytes) / 2**30
  return BuiltStep(compiled, state, batch, config, num_params, accum, init_s, compile_s,
                   temp_gib, peak_gib, kernel_launches(compiled.as_text()))


def kernel_launches(hlo: str) -> dict[str, int]:
  """Custom calls in a compiled program's HLO text: per kernel name (the name a Pallas kernel's
  call carries) and per custom-call target ("target:..."), how many call sites."""
  calls = "\n".join(line for line in hlo.splitlines() if "custom-call" in line)
  names = re.findall(r'\b(?:kernel_)?name\\?"?\s*[=:]\s*\\?"([A-Za-z_][\w.\-]*)\\?"', calls)
  targets = re.findall(r'custom_call_target="([^"]+)"', calls)
  return dict(sorted(collections.Counter(names + [f"target:{t}" for t in targets]).items()))


def out_of_memory(error: Exception) -> bool:
  """Whether an XLA runtime error is the device running out of memory."""
  return "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error)


def batch_that_fits(built: BuiltStep, batch_size: int) -> int | None:
  """The largest global batch (a multiple of this one) whose step memory fits the device.

  An estimate: the temporaries are taken to grow in proportion to the batch and the
  rest (state, gradients) to stay; None where the device reports no memory limit.
  """
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  if not limit or built.peak_gib is None or not built.temp_gib:
    return None
  fixed = built.peak_gib - built.temp_gib
  factor = int((limit / 2**30 - fixed) // built.temp_gib)
  return max(factor, 0) * batch_size


def bench_model(model: str, implementation: str, scan_layers: bool | None,
                args: argparse.Namespace, where: sharding_lib.MeshContext,
                label: str) -> dict[str, Any]:
  """Builds, compiles and times one model; returns its result row (with "error" and the
  compiled step's figures where the step ran out of device memory)."""
  built = build_train_step(model, implementation, scan_layers, args, where, label)
  log(f"{label} compiled in {built.compile_s:.1f} s; {args.warmup_steps} warm-up + "
      f"{args.steps} synced + {args.steps} queued steps ...")
  implementation = built.config.model.implementation
  if built.config.model.get("precision", "exact") == "rank1":  # the op is another one
    implementation = "fast_palimpsa (rank1)"
  model_cfg = built.config.model
  row = {"model": model, "implementation": implementation,
         "scan_layers": bool(model_cfg.get("scan_layers", scan_layers)),
         "remat": model_cfg.get("remat_saves", "nothing") if model_cfg.get("remat") else "off",
         "params": built.num_params, "layers": int(model_cfg.num_layers),
         "grad_accum_steps": built.grad_accum_steps, "init_s": built.init_s,
         "compile_s": built.compile_s, "temp_gib": built.temp_gib,
         "peak_gib": built.peak_gib,
         "batch_that_fits": batch_that_fits(built, args.batch_size),
         "kernel_launches": built.kernel_launches}
  try:
    timed = _time_steps(built, args, label)
  except jax.errors.JaxRuntimeError as error:
    if not out_of_memory(error):
      raise
    message = str(error).strip().splitlines()[0]
    log(f"{label} out of memory: {message}")
    size = re.search(r"allocate ([\d.]+ ?[KMGT]i?B)", message)
    return row | {"error": "out of memory" + (f" (allocating {size.group(1)})" if size else "")}
  tokens_per_s = args.batch_size * args.seq_len / timed["step_s"]
  peak = metrics_lib.peak_flops_per_device()
  mfu = (6 * built.num_params * tokens_per_s / (peak * where.mesh.size)) if peak else None
  synced = timed["synced"]
  row |= {"step_ms": 1e3 * timed["step_s"], "synced_ms_median": 1e3 * statistics.median(synced),
          "synced_ms_min": 1e3 * min(synced), "synced_ms_max": 1e3 * max(synced),
          "tokens_per_s": tokens_per_s, "mfu": mfu, "final_loss": timed["final_loss"],
          "paper_run_hours": PAPER_TOKENS / tokens_per_s / 3600}
  log(f"{label} step {row['step_ms']:.1f} ms queued ({row['synced_ms_median']:.1f} synced), "
      f"{tokens_per_s:,.0f} tokens/s, loss {row['final_loss']:.3f}")
  return row


def _time_steps(built: BuiltStep, args: argparse.Namespace, label: str) -> dict[str, Any]:
  """Runs warm-up, synced and queued steps: {"step_s" (queued), "synced" (seconds each),
  "final_loss"}; a non-finite loss or gradient raises."""
  state, all_metrics, synced = built.state, [], []
  for index in range(args.warmup_steps + args.steps):
    start = time.perf_counter()
    state, step_metrics = built.compiled(state, built.batch)
    jax.block_until_ready((state, step_metrics))
    if index >= args.warmup_steps:
      synced.append(time.perf_counter() - start)
    all_metrics.append(step_metrics)
  start = time.perf_counter()
  for _ in range(args.steps):
    state, step_metrics = built.compiled(state, built.batch)
    all_metrics.append(step_metrics)
  jax.block_until_ready((state, step_metrics))
  step_s = (time.perf_counter() - start) / args.steps
  all_metrics = jax.device_get(all_metrics)
  del state
  for index, step_metrics in enumerate(all_metrics):
    if not step_metrics["train/finite"]:
      raise trainer.NonFiniteError(
          f"{label}: non-finite loss or gradient at step {index + 1} (loss "
          f"{step_metrics['train/loss']}, grad norm {step_metrics['train/grad_norm']}).")
  return {"step_s": step_s, "synced": synced,
          "final_loss": float(all_metrics[-1]["train/loss"])}


def add_baseline_ratios(rows: list[dict[str, Any]]) -> None:
  """row["x_mamba2"]: step time over Mamba2's with the same scan_layers (None
  when that Mamba2 row was not run)."""
  for row in rows:
    if "error" in row:
      continue
    baseline = next((r for r in rows if r["model"] == registry.BASELINE and "error" not in r
                     and r["scan_layers"] == row["scan_layers"]), None)
    row["x_mamba2"] = (row["step_ms"] / baseline["step_ms"]
                       if baseline else None)


def _fmt(value: float | None, pattern: str) -> str:
  return "n/a" if value is None else format(value, pattern)


def format_table(rows: list[dict[str, Any]]) -> str:
  header = ("| model | implementation | scanned | remat | params (M) | layers | compile s "
            "| temp GiB | peak GiB | batch that fits (est.) | step ms (queued) | tokens/s | MFU "
            "| x Mamba2 step time | synced step ms (median) | synced min / max ms "
            "| final loss |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  lines = [header]
  for r in rows:
    built = (f"| {r['model']} | {r['implementation']} | {'yes' if r['scan_layers'] else 'no'} "
             f"| {r['remat']} | {r['params'] / 1e6:.1f} | {r['layers']} | {r['compile_s']:.1f} "
             f"| {_fmt(r['temp_gib'], '.2f')} | {_fmt(r['peak_gib'], '.2f')} "
             f"| {_fmt(r['batch_that_fits'], 'd')} ")
    if "error" in r:
      lines.append(built + f"| {r['error'].replace('|', '/')} |" + " - |" * 6)
      continue
    lines.append(
        built + f"| {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {_fmt(r['mfu'], '.1%')} "
        f"| {_fmt(r['x_mamba2'], '.2f')} | {r['synced_ms_median']:.1f} "
        f"| {r['synced_ms_min']:.1f} / {r['synced_ms_max']:.1f} | {r['final_loss']:.3f} |")
  return "\n".join(lines)


def projection_lines(rows: list[dict[str, Any]], num_devices: int) -> list[str]:
  """The paper's 15B-token run at each measured Palimpsa-D rate."""
  return [f"- 15B tokens (paper's 170M run) at Palimpsa-D {r['implementation']}'s "
          f"({'scanned' if r['scan_layers'] else 'unrolled'}) "
          f"{r['tokens_per_s']:,.0f} tokens/s: {r['paper_run_hours']:.1f} h "
          f"({r['paper_run_hours'] / 24:.2f} days) on {num_devices} device(s)"
          for r in rows if r["model"] == registry.DEFAULT and "error" not in r]


def main(argv: list[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; returns {"rows", "table", "device", "jax", ...}."""
  args = parse_args(argv)
  plan = run_plan(args)
  devices = jax.devices()
  if args.num_devices:
    if args.num_devices > len(devices):
      raise ValueError(f"--num_devices={args.num_devices} but only "
                       f"{len(devices)} devices are available")
    devices = devices[:args.num_devices]
  if args.batch_size % len(devices):
    raise ValueError(f"--batch_size={args.batch_size} must be a multiple of the "
                     f"{len(devices)} devices")
  where = placement(args, devices)
  mesh = where.mesh
  device_kind = devices[0].device_kind
  log(f"{device_kind} x{len(devices)} ({jax.default_backend()}), jax {jax.__version__}, "
      f"mesh {dict(mesh.shape)}, batch {args.batch_size} x {args.seq_len} tokens")

  if args.compilation_cache_dir:
    compile_cache.configure(args.compilation_cache_dir)
  argv_used = sys.argv[1:] if argv is None else argv
  command = results_lib.command_line("benchmarks.step.throughput", argv_used)
  now = results_lib.utc_now()
  result = {"date": now, "device": device_kind, "num_devices": len(devices),
            "backend": jax.default_backend(), "jax": jax.__version__,
            "command": command, "mesh": dict(mesh.shape), "size": args.size,
            "seq_len": args.seq_len, "batch_size": args.batch_size,
            "tokens_per_step": args.batch_size * args.seq_len,
            "warmup_steps": args.warmup_steps, "steps": args.steps,
            "remat": args.remat, "remat_saves": args.remat_saves,
            "kernel_sharding": not args.no_kernel_sharding,
            "context_parallel": args.context_parallel}
  rows = []
  for index, (model, implementation, scan) in enumerate(plan):
    label = (f"[{index + 1}/{len(plan)}] {model} ({implementation}, "
             f"{'scanned' if scan else 'unrolled'})")
    rows.append(bench_model(model, implementation, scan, args, where, label))
    add_baseline_ratios(rows)
    result["rows"] = rows
    if args.output:  # After every model, so that a cut-short run keeps its rows.
      pathlib.Path(args.output).write_text(json.dumps(result, indent=2))

  table = format_table(rows)
  projections = projection_lines(rows, len(devices))
  print(table)
  print("\n".join(projections))
  result.update(table=table, projections=projections)
  if not args.no_record:
    record = results_lib.make_record(
        "train_throughput",
        f"train_throughput {args.size}, {args.batch_size} x {args.seq_len} tokens per step",
        command, date=now, device=device_kind, num_devices=len(devices), table=table,
        figures={"kernel_launches": {f"{r['model']} {r['implementation']}":
                                     r["kernel_launches"] for r in rows}},
        settings={"size": args.size, "batch_size": args.batch_size, "seq_len": args.seq_len,
                  "mesh": dict(mesh.shape), "remat": args.remat,
                  "remat_saves": args.remat_saves,
                  "kernel_sharding": not args.no_kernel_sharding,
                  "context_parallel": args.context_parallel, "precision": args.precision,
                  "as_shipped": args.as_shipped},
        notes=[f"bf16 compute, f32 params, configs/lm.py optimizer, "
               + ("scan_layers and remat as configs/lm.py ships the size" if args.as_shipped
                  else f"remat {'on, saving ' + args.remat_saves if args.remat else 'off'}")
               + ", kernels "
               f"{'on the global batch' if args.no_kernel_sharding else 'per device shard'}"
               f"{', context-parallel path' if args.context_parallel else ''}; "
               f"{args.warmup_steps} warm-up steps, then {args.steps} steps queued (step ms, "
               f"tokens/s) and {args.steps} synced one by one; random tokens",
               *(line.removeprefix("- ") for line in projections)])
    log(f"wrote {results_lib.write_record(record, args.records)}")
  if args.output:
    pathlib.Path(args.output).write_text(json.dumps(result, indent=2))
    log(f"wrote {args.output}")
  return result


if __name__ == "__main__":
  main()

"""A train step compiled for a GPU on a host without one: its memory and its XLA traffic.

    python -m benchmarks.step.compiled --size 760m --batch_size 8 --as_shipped
    python -m benchmarks.step.compiled --size 760m --batch_size 4 --scan_layers on \\
        --hlo_out /tmp/step.hlo --top 30
    python -m benchmarks.step.compiled --mqar model=palimpsa_d    # the MQAR paper step

Takes benchmarks/step/throughput.py's model arguments (one model, --models palimpsa_d by
default), builds the train step as it does and compiles it with XLA's GPU compiler for the
--target GPU described in benchmarks/step/gpu_targets/ (no GPU is used: only abstract shapes), or
with --mqar the MQAR sweep's step of one run as `benchmarks.step.profile --mqar` builds it
(--mqar takes the same configs/mqar.py arguments, preset=paper unless given), then
prints the compiled step's memory analysis (what the GPU would allocate: the figures the GPU
records' "temp GiB" and "peak GiB" columns hold) and the bytes its non-GEMM fusions and copies
move, by source line (benchmarks/step/hlo_traffic.py). Needs jax's CUDA plugin importable, not a
GPU: the `jax-cuda12-pjrt` and `jax-cuda12-plugin` wheels of the installed jax version (checked
with 0.11.2), e.g. `pip install --target /tmp/cuda_plugin jax-cuda12-pjrt==0.11.2
jax-cuda12-plugin==0.11.2` and `PYTHONPATH=/tmp/cuda_plugin`, which leaves the environment
as it is; run it with JAX_PLATFORMS=cpu. The Palimpsa ops' GPU kernels are compiled for the
target too (their runtime check for an NVIDIA GPU is skipped while tracing).
"""

import argparse
import pathlib
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from benchmarks import results as results_lib
from benchmarks.step import hlo_traffic
from benchmarks.step import profile as step_profile
from benchmarks.step import throughput as train_throughput
from palimpsa_jax import models
from palimpsa_jax.models import registry
from palimpsa_jax.training import batched
from pallas_kernels.palimpsa_gpu import config as gpu_config
from pallas_kernels.palimpsa_gpu import op as gpu_op

TARGETS = {"h100": ("NVIDIA H100 80GB HBM3", (9, 0), 3352)}  # name, capability, GB/s
TARGET_DIR = pathlib.Path(__file__).with_name("gpu_targets")


def target_devices(target: str) -> list:
  """The devices of one `target` GPU, from its GpuTargetConfig (gpu_targets/TARGET.txtpb)."""
  try:
    description = topologies.get_topology_desc(
        target, "cuda", target_config=(TARGET_DIR / f"{target}.txtpb").read_text(),
        topology="1x1x1")
  except Exception as error:  # jax raises several kinds when the plugin is missing.
    raise SystemExit(f"benchmarks.step.compiled: no CUDA compiler on this host ({error}); put jax's "
                     "CUDA plugin on the path (see this module's docstring)") from None
  return list(description.devices)


def _compiled(step, *abstract_args, capability):
  """step (a jitted function) compiled for abstract_args and the target's `capability`."""
  # The kernels are built for the target's compute capability; the op's check for a local
  # NVIDIA GPU guards runs, and nothing here runs.
  with mock.patch.object(gpu_config, "compute_capability", lambda: capability), \
       mock.patch.object(gpu_op, "_check_nvidia_gpu", lambda: None):
    return step.lower(*abstract_args).compile()


def compile_mqar_step(config_arg: str, target: str):
  """The compiled MQAR step of one run of configs/mqar.py's `config_arg` (preset=paper unless
  given; benchmarks/step/profile.py's group) for `target` and its settings row."""
  name, capability, _ = TARGETS[target]
  device = target_devices(target)[0]
  (config,) = step_profile.group_configs(config_arg, 1)
  if config.model.implementation == "auto" and models.registry.KINDS[
      config.model.mixer].metaplastic:
    config.model.implementation = "pallas_gpu"  # What "auto" takes on a GPU.
  tasks, model = step_profile.group_model([config])
  on_device = lambda a: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(device))
  state = jax.eval_shape(jax.vmap(lambda seed: model._init_one(jax.random.key(seed))),
                         jnp.zeros((1,), jnp.int32))
  batch = batched.next_batch(tasks, [config.seed])
  start = time.perf_counter()
  compiled = _compiled(model.train_step, jax.tree.map(on_device, state),
                       jax.tree.map(on_device, batch),
                       on_device(jnp.zeros((1,), jnp.float32)),
                       on_device(jnp.ones((1,), bool)), capability=capability)
  model_config = config.model
  row = {"model": model_config.mixer, "device": f"{name} (compiled on a CPU host)",
         "precision": model_config.get("precision", "exact"), "remat": "off",
         "scanned": bool(model_config.scan_layers), "compile_s": time.perf_counter() - start}
  return compiled, row, config


def compile_step(args: argparse.Namespace, target: str):
  """The compiled train step of args' model for `target` and its settings row."""
  name, capability, _ = TARGETS[target]
  devices = target_devices(target)
  where = train_throughput.placement(args, devices)
  model = args.models.split(",")[0]
  scan = None if args.as_shipped else {"on": True, "off": False}[args.scan_layers]
  implementation = args.implementation
  if implementation == "auto" and models.registry.KINDS[model].metaplastic:
    implementation = "pallas_gpu"  # What "auto" takes on a GPU.
  parts = train_throughput.train_step_parts(model, implementation, scan, args, where)
  state = jax.eval_shape(parts.spec.init)
  batch_sharding = jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec())
  batch = {key: jax.ShapeDtypeStruct((args.batch_size, args.seq_len), jnp.int32,
                                     sharding=batch_sharding) for key in ("tokens", "targets")}
  start = time.perf_counter()
  compiled = _compiled(parts.train_step, state, batch, capability=capability)
  model_config = parts.config.model
  row = {"model": model, "device": f"{name} (compiled on a CPU host)",
         "precision": model_config.get("precision", "exact"),
         "remat": model_config.remat_saves if model_config.remat else "off",
         "scanned": bool(model_config.scan_layers), "compile_s": time.perf_counter() - start}
  return compiled, row


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(add_help=False)
  parser.add_argument("--target", default="h100", choices=sorted(TARGETS))
  parser.add_argument("--top", type=int, default=25, help="source lines listed")
  parser.add_argument("--hlo_out", default="", help="file for the compiled program's text")
  parser.add_argument("--mqar", default="", help="compile the MQAR step of these configs/mqar.py "
                      "arguments (preset=paper unless given) instead of a language model's")
  own, rest = parser.parse_known_args(argv)
  if "--models" not in rest:
    rest = ["--models", registry.DEFAULT, *rest]
  args = train_throughput.parse_args(rest)
  if "," in args.models:
    raise SystemExit("benchmarks.step.compiled: --models takes one model")
  if own.mqar:
    compiled, row, config = compile_mqar_step(own.mqar, own.target)
    args.size, args.batch_size, args.seq_len = "mqar", config.batch_size, config.seq_len
  else:
    compiled, row = compile_step(args, own.target)
  text = compiled.as_text()
  if own.hlo_out:
    pathlib.Path(own.hlo_out).write_text(text)
  memory = compiled.memory_analysis()
  row["temp_gib"] = memory.temp_size_in_bytes / 2**30
  row["peak_gib"] = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                     + memory.temp_size_in_bytes - memory.alias_size_in_bytes) / 2**30
  rows = hlo_traffic.traffic(text)
  row.update(hlo_traffic.totals(rows))
  bandwidth = TARGETS[own.target][2]
  table = hlo_traffic.markdown(rows, own.top, bandwidth)
  print(f"{row['model']} {args.size}, {args.batch_size} x {args.seq_len} tokens, "
        f"{row['device']}: compiled in {row['compile_s']:.0f} s; temp {row['temp_gib']:.2f} "
        f"GiB, peak {row['peak_gib']:.2f} GiB; XLA fusions move {row['fusion_gb']:.1f} GB "
        f"({row.get('scan_stacking_gb', 0):.1f} GB of it the scan's stacking)")
  print(table)
  if not args.no_record:
    argv_used = sys.argv[1:] if argv is None else argv
    record = results_lib.make_record(
        "compiled_step", f"compiled_step {row['model']} {args.size}, {args.batch_size} x "
        f"{args.seq_len} tokens ({own.target}, compiled on a CPU host)",
        results_lib.command_line("benchmarks.step.compiled", argv_used), table=table,
        figures={k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
        device=row["device"], num_devices=1, backend="cuda (compiled on a CPU host)",
        settings={"size": args.size, "batch_size": args.batch_size, "seq_len": args.seq_len,
                  "model": row["model"], "precision": row["precision"],
                  "remat": row["remat"], "scanned": row["scanned"],
                  "as_shipped": args.as_shipped, "target": own.target,
                  **({"mqar_config": own.mqar} if own.mqar else {})},
        notes=[f"GB: operands read plus outputs written by XLA's non-GEMM fusions and copies "
               f"(benchmarks/step/hlo_traffic.py); ms at the target's {bandwidth} GB/s, a floor "
               "on their time, not a timing"])
    print(f"record: {results_lib.write_record(record, args.records)}")
  return row


if __name__ == "__main__":
  main()

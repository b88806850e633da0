"""Registers and spills of Fast Palimpsa's Mosaic GPU kernels, compiled for an H100 on a CPU host.

    PYTHONPATH=/path/to/cuda_plugin JAX_PLATFORMS=cpu \
        python -m benchmarks.op.fast_palimpsa_registers [--only D760 K128] [--chunks 64] [--candidates]

Mosaic GPU writes a kernel's PTX when XLA compiles the program (not when it lowers it), and
runs ptxas on it then. So this compiles the op's forward+backward (`fast_palimpsa_gpu`,
bfloat16 inputs, the tuning benchmark's shapes) for an H100 described in `H100_TARGET`,
through the CUDA PJRT plugin's compiler, with Mosaic GPU's dumps on, and reads ptxas'
report of every kernel: registers per thread, bytes spilled, and whether ptxas serialized
the wgmma instructions for want of registers. No GPU is touched.

Needs, outside the project: the CUDA plugin of the pinned jax version importable (e.g.
`pip install --no-deps --target DIR jax-cuda12-pjrt==0.11.2 jax-cuda12-plugin==0.11.2`, then
DIR on PYTHONPATH) and ptxas (CUDA 12.8 or later) on PATH. One compile takes about a minute
on two CPU cores. --candidates compiles every tiling the tuning benchmark would time
(benchmarks/op/tuning.py) instead of the default tiles only.
"""

import argparse
import os
import pathlib
import re
import sys
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp

from benchmarks import results as results_lib
from benchmarks.op.timing import SHAPES
from benchmarks.op.tuning import (SMALL, TUNED_SHAPES, backward_candidates, describe,
                                  forward_candidates)
from palimpsa_jax.ops.fast_palimpsa.gpu import fast_palimpsa_gpu
from pallas_kernels.common import round_up
from pallas_kernels.fast_palimpsa_gpu import reads, support

# An H100 SXM as XLA's GPU compiler needs it without the card (a GpuTargetConfig).
H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version { major: 12 minor: 8 }
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
DUMP = {"MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1"}


def h100_device():
  """A compile-only H100 (no GPU needed); a clear exit where the CUDA plugin is missing."""
  from jax.experimental import topologies
  try:
    return topologies.get_topology_desc("h100", "cuda", target_config=H100_TARGET,
                                        topology="1x1x1").devices[0]
  except Exception as failure:  # pylint: disable=broad-except
    sys.exit(f"fast_palimpsa_registers: cannot describe an H100 to XLA ({failure}); the CUDA "
             f"PJRT plugin (jax-cuda12-pjrt and jax-cuda12-plugin {jax.__version__}) must be "
             f"importable (see this module's docstring)")


def parse_ptxas(text: str) -> dict:
  """ptxas -v's report of one kernel: registers, spill stores and loads (bytes), and whether
  it serialized wgmma for want of registers."""
  used = re.search(r"Used (\d+) registers", text)
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
  return dict(registers=int(used.group(1)) if used else None,
              spill_stores=int(spills.group(1)) if spills else 0,
              spill_loads=int(spills.group(2)) if spills else 0,
              wgmma_serialized="wgmma.mma_async instructions are serialized" in text)


def compile_op(shape, chunk, tiles, with_var, device):
  """Compiles the op's forward+backward at this shape (bfloat16 inputs) for `device`."""
  b, t, h, kd, vd = shape
  sds = lambda s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
      s, dtype, sharding=jax.sharding.SingleDeviceSharding(device))

  def loss(q, k, v, beta, log_alpha, ip):
    mu0 = jnp.zeros((b, h, vd, kd), jnp.float32)
    prec0 = jnp.broadcast_to(ip[None, :, None, None], mu0.shape)
    out, var, _, _ = fast_palimpsa_gpu(q, k, v, beta, log_alpha, ip, mu0, prec0, None,
                                       return_variance=with_var, chunk_size=chunk,
                                       read_tiles=tiles)
    total = jnp.sum(out.astype(jnp.float32))
    return total + jnp.sum(var) if with_var else total

  args = (sds((b, t, h, kd)), sds((b, t, h, kd)), sds((b, t, h, vd)), sds((b, t, h, vd)),
          sds((b, t, h), jnp.float32), sds((h,), jnp.float32))
  # The kernels check for a Hopper device at trace time; here the target is one.
  with mock.patch.object(support, "hopper_available", lambda: True):
    jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)))).lower(*args).compile()


def kernel_reports(dump: pathlib.Path, seen: set) -> list[tuple[str, dict]]:
  """(kernel name, parse_ptxas) of the ptxas reports written since `seen` (updated)."""
  new = sorted((p for p in dump.glob("*.ptxas") if p.name not in seen),
               key=lambda p: p.stat().st_mtime)
  seen.update(p.name for p in new)
  for p in dump.glob("*.mlir-passes.log"):  # Large, and not read here.
    p.unlink()
  return [(re.sub(r"_\d+$", "", p.stem), parse_ptxas(p.read_text())) for p in new]


def format_table(rows) -> str:
  lines = ["| shape | C | variance | tiles | kernel | registers | spill stores / loads (B) | "
           "wgmma serialized |", "|---|---|---|---|---|---|---|---|"]
  for name, chunk, with_var, label, kernel, r in rows:
    lines.append(f"| {name} | {chunk} | {with_var} | {label} | {kernel} | {r['registers']} | "
                 f"{r['spill_stores']} / {r['spill_loads']} | "
                 f"{'yes' if r['wgmma_serialized'] else 'no'} |")
  return "\n".join(lines)


def tilings(shape, chunk, with_var, candidates):
  """(label, tiles) to compile: the default tiles, or every fitting tuning candidate."""
  kp, vp = round_up(shape[3], 16), round_up(shape[4], 16)
  if not candidates:
    tiles = reads.default_tiles(chunk, kp, vp, with_var)
    return [("default: " + describe(tiles, "both"), tiles)]
  default_bwd = reads.default_tiles(chunk, kp, vp, with_var)[1]
  default_fwd = reads.default_tiles(chunk, kp, vp, with_var)[0]
  pairs = ([(f, default_bwd) for f in forward_candidates(chunk, vp, False)]
           + [(default_fwd, b) for b in backward_candidates(chunk, vp, False)])
  return [(describe(tiles, "both"), tiles) for tiles in dict.fromkeys(pairs)
          if reads.fits(tiles, kp, vp, with_var)]


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.splitlines()[0])
  parser.add_argument("--only", nargs="+", choices=TUNED_SHAPES["perf"] + TUNED_SHAPES["small"],
                      help="shapes (default: D760, D170, K128, MQAR)")
  parser.add_argument("--chunks", type=results_lib.positive_ints, default=[64],
                      help="comma-separated chunk sizes (default 64)")
  parser.add_argument("--variance", action="store_true", help="with the variance's cotangent")
  parser.add_argument("--candidates", action="store_true",
                      help="every tiling the tuning benchmark times, not only the default")
  results_lib.add_record_flags(parser)
  args = parser.parse_args(argv)
  device = h100_device()
  shapes = SHAPES["perf"] | SMALL
  dump = pathlib.Path(tempfile.mkdtemp(prefix="mosaic_ptx_"))
  os.environ.update(DUMP, MOSAIC_GPU_DUMP_TO=str(dump))
  rows, seen, start = [], set(), time.perf_counter()
  for chunk in args.chunks:
    for name in args.only or TUNED_SHAPES["perf"]:
      for label, tiles in tilings(shapes[name], chunk, args.variance, args.candidates):
        compile_op(shapes[name], chunk, tiles, args.variance, device)
        for kernel, report in kernel_reports(dump, seen):
          rows.append((name, chunk, args.variance, label, kernel, report))
        print(f"[{time.perf_counter() - start:6.0f} s] {name} C={chunk} {label}: compiled",
              file=sys.stderr, flush=True)
  table = format_table(rows)
  print(table)
  if not args.no_record:
    record = results_lib.make_record(
        "fast_palimpsa_registers", "Fast Palimpsa kernels' registers and spills (ptxas, sm_90a)",
        results_lib.command_line("benchmarks.op.fast_palimpsa_registers", argv), table=table,
        settings=dict(only=args.only, chunks=args.chunks, variance=args.variance,
                      candidates=args.candidates, target="H100 (compiled on a CPU host)"))
    print(f"record: {results_lib.write_record(record, args.records)}", file=sys.stderr)


if __name__ == "__main__":
  main()

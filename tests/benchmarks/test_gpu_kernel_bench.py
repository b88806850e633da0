"""benchmarks/gpu_kernel_bench.py: a row of its record and the sweep's variants (the timing
itself needs a GPU)."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import gpu_kernel_bench
from benchmarks import results as results_lib
from pallas_kernels.palimpsa_gpu import config as gpu_config
from pallas_kernels.palimpsa_gpu import make_config


def test_table_row_against_the_floor_and_the_authors_kernel():
  row = gpu_kernel_bench.table_row("D170", (4, 4096, 16, 48, 48), (0.5, 1.25, 2.0), 2.0, 10.0,
                                   None)
  (cells,) = results_lib.parse_table(gpu_kernel_bench.TABLE_HEADER + "\n" + row)["rows"]
  elem = 4 * 4096 * 16 * 48 * 48
  assert cells[:7] == ["D170", "(4, 4096, 16, 48, 48)", "0.500", "1.250", "2.000", "2.000",
                       "10.000"]
  assert float(cells[7]) == pytest.approx(elem / 4.2e12 * 1e3 / 2.0, abs=0.005)
  assert float(cells[8]) == pytest.approx(elem / 1.2e12 * 1e3 / 10.0, abs=0.005)
  assert cells[9:] == ["3.4 / 3.1", "-"]  # 6.76 / 2.0 and 30.9 / 10.0; no memory analysis
  assert gpu_kernel_bench.table_row("tiny", (1, 8, 1, 4, 4), (1, 1, 1), 1, 1, 3.0).endswith(
      "| - | 3.0 |")


def test_each_sweep_variant_changes_its_own_stage(monkeypatch):
  """The tile sweep's variants of a D170 call on sm_90 (built on a CPU): each replaces the
  tiles of the stage it times, and only those; every timed stage has variants."""
  monkeypatch.setattr(gpu_config, "compute_capability", lambda: (9, 0))
  sds, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
  rows = sds((4, 4096, 16, 48), bf16)
  base = make_config(rows, rows, sds((4, 4096, 16), f32), sds((16,), f32),
                     return_variance=False, chunk_size=64, interpret=False)
  variants = gpu_kernel_bench._variants(base)  # pylint: disable=protected-access
  assert {stage for stage, _, _ in variants} == set(gpu_kernel_bench.STAGES)
  for stage, label, cfg in variants:
    changed = {s for s in gpu_config.STAGES if getattr(cfg, s) != getattr(base, s)}
    assert changed <= {gpu_kernel_bench._OP_STAGES[stage]}, label  # pylint: disable=protected-access

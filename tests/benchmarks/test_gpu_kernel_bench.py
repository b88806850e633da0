"""benchmarks/gpu_kernel_bench.py: a row of its record (the timing itself needs a GPU)."""

import pytest

from benchmarks import gpu_kernel_bench
from benchmarks import results as results_lib


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

"""benchmarks/step/hlo_traffic.py on programs compiled here, and compiled_step's refusal without a
CUDA compiler."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.step import compiled as compiled_step
from benchmarks.step import hlo_traffic


def _rows(fn, *args):
  return hlo_traffic.traffic(jax.jit(fn).lower(*args).compile().as_text())


def test_an_elementwise_kernel_reads_its_input_and_writes_its_output():
  x = jnp.zeros((1000, 1000), jnp.float32)
  rows = _rows(lambda x: jnp.tanh(x * 2.0 + 1.0), x)
  assert sum(r.bytes for r in rows) == 2 * x.size * 4
  assert sum(r.launches for r in rows) == 1
  assert rows[0].where.startswith("test_hlo_traffic.py:")


def test_a_loop_body_counts_once_per_trip_and_a_stacked_output_its_slot():
  x = jnp.zeros((100, 100), jnp.float32)

  def stacked(x):
    def body(carry, _):
      carry = jnp.sin(carry)
      return carry, carry
    return jax.lax.scan(body, x, None, length=7)[1]

  rows = _rows(stacked, x)
  in_loop = [r for r in rows if r.launches % 7 == 0 and r.launches]
  assert in_loop, rows
  # Each trip reads the carry and writes it and its slot of the stacked output, never the
  # whole [7, 100, 100] stack.
  per_trip = sum(r.bytes for r in in_loop) / 7
  assert 2 * x.size * 4 <= per_trip <= 4 * x.size * 4, rows


def test_markdown_and_totals():
  rows = [hlo_traffic.Traffic("fusion", "a.py:1 (f)", 2, 3e9),
          hlo_traffic.Traffic("fusion", hlo_traffic.SCAN_SOURCE, 1, 1e9)]
  table = hlo_traffic.markdown(rows, 5, bandwidth_gb_s=1000)
  assert "| fusion | a.py:1 (f) | 2 | 3.00 | 3.00 |" in table
  assert hlo_traffic.totals(rows) == {"fusion_gb": 4.0, "fusion_launches": 3,
                                      "scan_stacking_gb": 1.0}


def test_compiled_step_refuses_without_a_cuda_compiler():
  try:
    compiled_step.target_devices("h100")
  except SystemExit as error:
    assert "no CUDA compiler on this host" in str(error)
  else:
    pytest.skip("this host has jax's CUDA plugin")

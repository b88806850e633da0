"""models/activation_memory.py: the step-memory estimate, the remat rule, configs/lm.py's choice."""

import importlib.util
import pathlib

import pytest

from benchmarks import results as results_lib
from palimpsa_jax.models import activation_memory, model_config

REPO = pathlib.Path(__file__).resolve().parents[2]


def _lm_config_module():
  spec = importlib.util.spec_from_file_location("lm_config", REPO / "configs" / "lm.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_remat_choice_takes_the_first_policy_that_fits():
  config = model_config("palimpsa_d", "tiny", dtype="bfloat16", num_layers=16)
  estimate = {saves: activation_memory.estimated_step_gib(config, 2, 256, saves)
              for saves in activation_memory.POLICIES}
  # Each policy keeps less than the one before it.
  values = [estimate[saves] for saves in activation_memory.POLICIES]
  assert values[0] > values[1] and values[-2] > values[-1], estimate
  choose = lambda budget: activation_memory.remat_choice(config, 2, 256, budget)
  assert choose(estimate[None]) == (False, "nothing")
  between = (estimate[None] + estimate["matmuls_readouts_and_states"]) / 2
  assert choose(between) == (True, "matmuls_readouts_and_states")
  assert choose(0.0) == (True, "nothing")  # Nothing fits: keep the least.


@pytest.mark.parametrize("precision", ["exact", pytest.param("rank1", marks=pytest.mark.slow)])
def test_shipped_760m_config_fits_one_80_gb_gpu(precision):
  lm = _lm_config_module()
  args = lm.parse_args(f"size=760m,precision={precision}")
  assert (args.device_batch, args.seq_len) == (8, 4096)
  config = model_config("palimpsa_d", "760m", dtype=args.dtype, precision=precision)
  saves = args.remat_saves if args.remat else None
  assert activation_memory.estimated_step_gib(
      config, args.device_batch, args.seq_len, saves) <= lm.STEP_BUDGET_GIB
  if args.remat:  # Remat only where the step does not fit without it.
    assert activation_memory.estimated_step_gib(
        config, args.device_batch, args.seq_len, None) > lm.STEP_BUDGET_GIB


def _measured_760m_steps() -> list[tuple[dict, dict]]:
  """(settings, row) of the train-step records of Palimpsa-D 760M at 8 x 4096 with the
  compiled step's memory, from benchmarks/records (benchmarks/train_throughput.py's)."""
  found = []
  for record in results_lib.load_records():
    settings = record.get("settings", {})
    if (record["benchmark"] != "train_throughput" or settings.get("size") != "760m"
        or settings.get("batch_size") != 8 or settings.get("seq_len") != 4096
        or "remat_saves" not in settings or "precision" not in settings):
      continue
    columns = record["table"]["columns"]
    for cells in record["table"]["rows"]:
      row = dict(zip(columns, cells))
      if row["model"] == "palimpsa_d" and row.get("peak GiB") not in (None, "n/a"):
        found.append((settings, row))
  return found


@pytest.mark.parametrize("measured", _measured_760m_steps() or [None])
def test_estimate_holds_to_the_gpu_records(measured):
  """The estimate is never below the compiled step's peak that a GPU record measured, and
  at most 15% above it: COMPILED_OVER_TRACED is the records' ratio."""
  if measured is None:
    pytest.skip("no GPU train-step record of Palimpsa-D 760M at 8 x 4096 yet "
                "(python -m benchmarks.gpu_round writes it)")
  settings, row = measured
  config = model_config("palimpsa_d", "760m", dtype="bfloat16",
                        precision=settings["precision"])
  if "remat" in row:  # The row says what ran (train_throughput --as_shipped takes the config's).
    saves = None if row["remat"] == "off" else row["remat"]
  else:
    saves = settings["remat_saves"] if settings["remat"] else None
  estimate = activation_memory.estimated_step_gib(config, 8, 4096, saves)
  peak = float(row["peak GiB"])
  assert peak <= estimate <= 1.15 * peak, (settings, peak, estimate)

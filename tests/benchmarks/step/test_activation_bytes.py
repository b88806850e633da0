"""benchmarks/step/activation_bytes.py: the guard on Palimpsa-D 760M's activation bytes, the table."""

import json

import pytest

from benchmarks.step import activation_bytes

# Bytes per token and layer that Palimpsa-D 760M's block may keep for its backward without
# remat at 8 x 4096 tokens (docs/activation_memory.md): at 19 layers and 32,768
# tokens a device, 100 KB is 58 GiB of the step's traced bytes (configs/lm.py picks remat
# from them: tests/models/test_activation_memory.py).
PALIMPSA_D_760M_LIMIT = 100_000


@pytest.mark.parametrize("precision", ["exact", "rank1"])
def test_palimpsa_d_760m_keeps_at_most_100_kb_per_token_layer(precision):
  config = activation_bytes.block_config("palimpsa_d", "760m", precision)
  kept = activation_bytes.saved_bytes(config, batch=8, seq_len=4096)
  assert kept["per_token"] <= PALIMPSA_D_760M_LIMIT, kept
  # Most of it is the compute dtype: float32 only for the residual stream and small gates.
  assert kept["float32"] <= 0.25 * kept["per_token"], kept


def test_remat_policies_keep_less_than_no_remat():
  config = activation_bytes.block_config("palimpsa_d", "170m")
  plain = activation_bytes.saved_bytes(config, batch=2, seq_len=256)["per_token"]
  kept = {name: activation_bytes.saved_bytes(config, 2, 256, name)["per_token"]
          for name in ("nothing", "matmuls", "matmuls_readouts_and_states")}
  assert kept["nothing"] < kept["matmuls"] < kept["matmuls_readouts_and_states"] < plain
  # Only the block's input (float32 residual stream) with nothing saved.
  assert kept["nothing"] == pytest.approx(4 * config.d_model)


def test_table_and_record(tmp_path, capsys):
  rows = activation_bytes.main(["--models", "palimpsa_d,gated_deltanet", "--sizes", "170m",
                                "--batch", "1", "--seq_len", "256", "--records",
                                str(tmp_path)])
  assert [r["model"] for r in rows] == ["palimpsa_d", "gated_deltanet"]
  out = capsys.readouterr().out
  assert "| palimpsa_d | 170m | exact | 19 |" in out
  (path,) = tmp_path.glob("activation_bytes_*.json")
  record = json.loads(path.read_text())
  assert record["settings"]["sizes"] == ["170m"]
  assert record["command"].startswith("python -m benchmarks.step.activation_bytes --models")
  assert len(record["table"]["rows"]) == 2

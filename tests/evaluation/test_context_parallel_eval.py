"""The lm / long_context scorer with rows split over devices equals one device."""

_SCRIPT = """
import chex, jax, numpy as np
from flax import nnx
from palimpsa_jax import models
from palimpsa_jax.evaluation import lm
assert jax.device_count() == 4
config = models.model_config("palimpsa_d", "tiny", dtype="float32", chunk_size=4)
model = models.build_model(config, nnx.Rngs(0))
rng = np.random.default_rng(0)
tokens = rng.integers(0, config.vocab_size, (2, 32))
segment_ids = np.repeat([[0, 1]], 2, 0).repeat([12, 20], 1)
targets = rng.integers(0, config.vocab_size, (2, 32))
want = lm.ModelScorer(model)(tokens, segment_ids, targets)
got = lm.ModelScorer(model, sequence_devices=4)(tokens, segment_ids, targets)
chex.assert_trees_all_close(got[0], want[0], rtol=1e-5, atol=1e-5)
chex.assert_trees_all_equal(got[1], want[1])
try:
  lm.ModelScorer(model, sequence_devices=4)(tokens[:, :30], segment_ids[:, :30], targets[:, :30])
except ValueError as error:
  assert "cannot be split over 4 devices" in str(error), error
else:
  raise AssertionError("30 tokens over 4 devices were accepted")
print("ok")
"""


def test_scorer_splits_rows_over_devices(run_on_cpu_devices):
  result = run_on_cpu_devices(_SCRIPT, 4, timeout=600)
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]

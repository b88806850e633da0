"""Parameter initialisation on the host equals the on-device initialiser."""

import pytest

from palimpsa_jax.training import state as state_lib

_COMPARE = """
import jax
import ml_collections
import numpy as np
from palimpsa_jax.training import optimizer as optimizer_lib
from palimpsa_jax.training import sharding as sharding_lib
from palimpsa_jax.training import state as state_lib
from tests.training import tiny_lm

assert jax.device_count() == 4
mesh = sharding_lib.make_mesh(
    ml_collections.ConfigDict({"data": 1, "fsdp": 2, "tensor": 2}))
optimizer = ml_collections.ConfigDict(dict(
    learning_rate=1e-2, warmup_fraction=0.1, decay_steps=None, end_fraction=0.1, b1=0.9,
    b2=0.95, eps=1e-15, weight_decay=0.1, clip_norm=1.0))
states = []
for init_on_host in (False, True):
  spec = state_lib.make_train_state_spec(
      lambda rngs: tiny_lm.TinyLM(tiny_lm.VOCAB, 8, rngs), 3,
      lambda _: optimizer_lib.make_optimizer(optimizer, 10, tiny_lm.decay_mask),
      mesh, sharding_lib.DEFAULT_RULES, init_on_host=init_on_host)
  states.append(spec.init())
on_device, on_host = states
assert jax.tree.structure(on_device) == jax.tree.structure(on_host)
for device_leaf, host_leaf, expected in zip(
    jax.tree.leaves(on_device), jax.tree.leaves(on_host),
    jax.tree.leaves(spec.shardings)):
  assert host_leaf.dtype == device_leaf.dtype
  np.testing.assert_array_equal(np.asarray(host_leaf), np.asarray(device_leaf))
  assert host_leaf.sharding.is_equivalent_to(expected, host_leaf.ndim)
  assert host_leaf.sharding.is_equivalent_to(device_leaf.sharding, host_leaf.ndim)
kernel = on_host["params"]["mix"]["kernel"]
assert len(kernel.addressable_shards) == 4
assert kernel.addressable_shards[0].data.shape == (8, 4)  # [16, 8] on fsdp x tensor.
assert float(np.abs(np.asarray(kernel)).max()) > 0  # Random, not zeros.
print("host init matches")
"""


def test_host_init_matches_device_init_on_four_devices(run_on_cpu_devices):
  result = run_on_cpu_devices(_COMPARE, 4)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "host init matches" in result.stdout


def test_init_on_host_values():
  assert state_lib.resolve_init_on_host(True) is True
  assert state_lib.resolve_init_on_host(False) is False
  assert state_lib.resolve_init_on_host("auto") is False  # The CPU backend.
  with pytest.raises(ValueError, match="init_on_host must be 'auto', True or False"):
    state_lib.resolve_init_on_host("yes")

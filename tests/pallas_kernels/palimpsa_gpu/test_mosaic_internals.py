"""The version check around the private Mosaic GPU helpers of the Mosaic walk (CPU only)."""

from jax.experimental.mosaic import gpu as mgpu
import pytest

from pallas_kernels.palimpsa_gpu import mosaic_internals


def test_this_jax_has_the_private_helpers():
  mosaic_internals.check()
  assert callable(mosaic_internals.fast_instr("fma.rn.f32"))


@pytest.mark.parametrize("name", mosaic_internals.PRIVATE_NAMES)
def test_a_missing_helper_names_the_jax_it_was_written_for(monkeypatch, name):
  monkeypatch.delattr(mgpu.FragmentedArray, name)
  with pytest.raises(RuntimeError, match=f"FragmentedArray.{name}.*written for jax 0.11.2"):
    mosaic_internals.check()
  with pytest.raises(RuntimeError, match="written for jax"):
    mosaic_internals.fast_instr("fma.rn.f32")

"""The name every mixer gives its sequence op's output (a remat policy can keep it)."""

import jax
from jax.ad_checkpoint import checkpoint_name

READOUT = "mixer_readout"


def named_readout(out: jax.Array) -> jax.Array:
  """out unchanged, named READOUT for jax.checkpoint policies (models.REMAT_SAVES)."""
  return checkpoint_name(out, READOUT)

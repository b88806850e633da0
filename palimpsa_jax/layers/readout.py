"""The name every mixer gives its sequence op's output (a remat policy can keep it)."""

import jax
from jax.ad_checkpoint import checkpoint_name

READOUT = "mixer_readout"


def named_readout(out: jax.Array) -> jax.Array:
  """out unchanged, named READOUT for jax.checkpoint policies (models.REMAT_SAVES).

  The backward keeps the readout, and in a scanned model that is a write into the scan's
  stacked residuals besides the mixer's own use. XLA's GPU compiler (jaxlib 0.11.2) fuses a
  kernel whose output goes to such a write into a copy of the kernel that writes in place,
  and leaves the original kernel for the other use: the op's forward kernel ran twice per
  layer. An optimization barrier between the op and its users hides the kernel from that
  rewrite (the barrier moves no data); the gradient passes through unchanged.
  """
  return checkpoint_name(_behind_barrier(out), READOUT)


@jax.custom_vjp
def _behind_barrier(x: jax.Array) -> jax.Array:
  return jax.lax.optimization_barrier(x)


def _behind_barrier_fwd(x):
  return jax.lax.optimization_barrier(x), None


def _behind_barrier_bwd(_, cotangent):
  # No barrier on the cotangent: XLA may fuse its producer into the op's backward.
  return (cotangent,)


_behind_barrier.defvjp(_behind_barrier_fwd, _behind_barrier_bwd)

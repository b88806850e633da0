"""Palimpsa op: the shared suite per XLA implementation, validation, reference, memory."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
from jax.test_util import check_grads
import numpy as np
import pytest

from palimpsa_jax.ops import PalimpsaState, palimpsa
from palimpsa_jax.ops import dispatch
from palimpsa_jax.ops.palimpsa import api, implementations, reference_palimpsa
from palimpsa_jax.ops.palimpsa.chunked import palimpsa_chunked
from tests.ops.numerics import FLOAT32_TOL, GRAD_TOL, assert_close_to_reference
from tests.ops.palimpsa.palimpsa_suite import PalimpsaSuite


class TestSequential(PalimpsaSuite):
  IMPLEMENTATION = "sequential"


class TestAssociative(PalimpsaSuite):
  IMPLEMENTATION = "associative"
  SHAPES = PalimpsaSuite.SHAPES[:2]
  LONG_RUN = False  # materialises every state


class TestChunked(PalimpsaSuite):
  IMPLEMENTATION = "chunked"
  # 75 chunks: the backward recomputes them in groups of 3 (more than 32 chunks).
  SHAPES = PalimpsaSuite.SHAPES + (((1, 300, 1, 4, 3), 4, ((121, 179),)),)


def _small_inputs(seed=0, shape=(2, 13, 2, 4, 3)):
  b, t, h, kd, vd = shape
  rng = np.random.default_rng(seed)
  return dict(
      q=rng.standard_normal((b, t, h, kd)) / 2, k=rng.standard_normal((b, t, h, kd)) / 2,
      v=rng.standard_normal((b, t, h, vd)), beta=rng.uniform(0, 1, (b, t, h, vd)),
      log_alpha=np.log(rng.uniform(0.6, 1.0, (b, t, h))),
      prior_precision=rng.uniform(0.5, 2.0, (h,)),
      segment_ids=np.repeat([[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2]], b, 0).astype(np.int32))


def _f32(x):
  return {n: jnp.asarray(a, jnp.int32 if n == "segment_ids" else jnp.float32)
          for n, a in x.items()}


def _bad_cases():
  x = _f32(_small_inputs())
  b, t, h, kd = x["q"].shape
  vd = x["v"].shape[-1]
  state = PalimpsaState(jnp.zeros((b, h, vd, kd)), jnp.ones((b, h, vd, kd)))
  return [
      ("q", ValueError, dict(q=x["q"][0])),
      ("k", ValueError, dict(k=x["k"][:, :, :, :-1])),
      ("v", ValueError, dict(v=x["v"][:, :-1])),
      ("beta", ValueError, dict(beta=x["beta"][..., :-1])),
      ("log_alpha", ValueError, dict(log_alpha=x["log_alpha"][..., None])),
      ("prior_precision", ValueError, dict(prior_precision=jnp.ones((h + 1,)))),
      ("q", ValueError, dict(q=x["q"][:, :0], k=x["k"][:, :0], v=x["v"][:, :0],
                             beta=x["beta"][:, :0], log_alpha=x["log_alpha"][:, :0],
                             segment_ids=None)),
      ("q", TypeError, dict(q=x["q"].astype(jnp.int32))),
      ("v", TypeError, dict(v=x["v"].astype(jnp.int32))),
      ("prior_precision", TypeError, dict(prior_precision=jnp.ones((h,), jnp.int32))),
      ("segment_ids", TypeError, dict(segment_ids=x["segment_ids"].astype(jnp.float32))),
      ("segment_ids", ValueError, dict(segment_ids=x["segment_ids"][:, :-1])),
      ("initial_state", TypeError, dict(initial_state=(state.mu, state.precision))),
      ("initial_state.mu", ValueError, dict(initial_state=state._replace(mu=state.mu[..., :-1]))),
      ("initial_state.precision", TypeError,
       dict(initial_state=state._replace(precision=state.precision.astype(jnp.int32)))),
      ("implementation", ValueError, dict(implementation="cuda")),
      ("chunk_size", ValueError, dict(chunk_size=0)),
      ("chunk_size", TypeError, dict(chunk_size=2.0)),
  ]


@pytest.mark.parametrize("name,error,override", _bad_cases(),
                         ids=[f"{c[0]}-{c[1].__name__}-{i}" for i, c in enumerate(_bad_cases())])
def test_bad_input_names_the_argument(name, error, override):
  x = {**_f32(_small_inputs()), **override}
  kwargs = {n: x.pop(n) for n in ("initial_state", "segment_ids", "implementation", "chunk_size")
            if n in x}
  with pytest.raises(error, match=name):
    palimpsa(x["q"], x["k"], x["v"], x["beta"], x["log_alpha"], x["prior_precision"], **kwargs)


def test_reference_gradients_check_numerically():
  x = _small_inputs(1, (1, 6, 1, 3, 2))
  seg = jnp.asarray(np.array([[0, 0, 0, 1, 1, 1]], np.int32))
  with jax.enable_x64(True):
    def fn(q, k, v, beta, log_alpha, prior_precision):
      r = reference_palimpsa(q, k, v, beta, log_alpha, prior_precision, segment_ids=seg)
      return r.out, r.variance, r.state.mu, r.state.precision

    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "beta", "log_alpha", "prior_precision")]
    check_grads(fn, args, order=1, modes=("rev",))


@pytest.mark.parametrize("with_state", [False, True])
def test_beta_none_is_beta_zero(with_state):
  """beta=None (SimpleGLA path from the prior, general path from a state) == reference(beta=0)."""
  x = _small_inputs(2)
  b, _, h, kd = x["q"].shape
  vd = x["v"].shape[-1]
  rng = np.random.default_rng(3)
  state = (rng.standard_normal((b, h, vd, kd)), rng.uniform(0.5, 2, (b, h, vd, kd)))
  names = ("q", "k", "v", "log_alpha", "prior_precision")

  def loss(fn, q, k, v, la, ip, mu0, p0, seg):
    init = PalimpsaState(mu0, p0) if with_state else None
    r = fn(q, k, v, None, la, ip, initial_state=init, segment_ids=seg)
    return jnp.sum(r.out ** 2) + jnp.sum(r.variance) + jnp.sum(r.state.mu * r.state.precision)

  grad = jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5, 6, 7))
  op = jax.tree_util.Partial(palimpsa, return_variance=True)
  got = jax.jit(grad, static_argnums=0)(op, *(jnp.asarray(x[n], jnp.float32) for n in names),
                                        *(jnp.asarray(s, jnp.float32) for s in state),
                                        jnp.asarray(x["segment_ids"]))
  with jax.enable_x64(True):
    want = grad(reference_palimpsa, *(jnp.asarray(x[n]) for n in names),
                *(jnp.asarray(s) for s in state), jnp.asarray(x["segment_ids"]))
    want = jax.tree.map(np.asarray, want)
  assert_close_to_reference(got[0], want[0], FLOAT32_TOL)
  grads = got[1] if with_state else got[1][:5]
  assert_close_to_reference(grads, want[1][:len(grads)], GRAD_TOL)


def test_auto_on_cpu_matches_reference():
  x = _small_inputs(6)
  r = jax.jit(functools.partial(palimpsa, return_variance=True))(
      *(jnp.asarray(x[n], jnp.float32) for n in
        ("q", "k", "v", "beta", "log_alpha", "prior_precision")),
      segment_ids=jnp.asarray(x["segment_ids"]))
  with jax.enable_x64(True):
    ref = reference_palimpsa(*(jnp.asarray(x[n]) for n in
                               ("q", "k", "v", "beta", "log_alpha", "prior_precision")),
                             segment_ids=jnp.asarray(x["segment_ids"]))
    ref = jax.tree.map(np.asarray, ref)
  assert_close_to_reference((r.out, r.variance), (ref.out, ref.variance), FLOAT32_TOL)


def test_chunked_backward_memory_is_sublinear_in_states():
  """Compiled fwd+bwd temp memory at B=1, H=2, T=16384, K=V=64 < 25% of all T states."""
  b, t, h, kd, vd = 1, 16384, 2, 64, 64
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)

  def loss(q, k, v, beta, gate, ip, m0, ibar0):
    out, _, m, ibar = palimpsa_chunked(q, k, v, beta, gate, ip, m0, ibar0,
                                       return_variance=False, chunk_size=64)
    return jnp.sum(out) + jnp.sum(m) + jnp.sum(ibar)

  compiled = jax.jit(jax.grad(loss, argnums=tuple(range(8)))).lower(
      f32(b, t, h, kd), f32(b, t, h, kd), f32(b, t, h, vd), f32(b, t, h, vd), f32(b, t, h),
      f32(h), f32(b, h, vd, kd), f32(b, h, vd, kd)).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  all_states = t * vd * kd * 4 * b * h
  assert temp < 0.25 * all_states, f"temp {temp / 2**20:.1f} MiB vs states {all_states / 2**20} MiB"


def _declining(reason):
  """The table's "pallas_gpu" entry, made to support no call, for `reason`."""
  entry = implementations.IMPLEMENTATIONS["pallas_gpu"]
  return dataclasses.replace(entry, supports=lambda call: reason)


def test_auto_falls_back_to_chunked(monkeypatch):
  """Under "auto", a kernel that does not support the call or is missing -> "chunked"."""
  x = _f32(_small_inputs(7))
  args = [x[n] for n in ("q", "k", "v", "beta", "log_alpha", "prior_precision")]
  want = palimpsa(*args, implementation="chunked").out
  monkeypatch.setattr(dispatch, "platform", lambda: "cuda")
  assert api.auto_implementation() == "pallas_gpu"
  monkeypatch.setitem(implementations.IMPLEMENTATIONS, "pallas_gpu", _declining("test"))
  chex.assert_trees_all_equal(palimpsa(*args).out, want)
  missing = dispatch.unavailable(ImportError("test: no module"))
  monkeypatch.setitem(implementations.IMPLEMENTATIONS, "pallas_gpu", missing)
  chex.assert_trees_all_equal(palimpsa(*args).out, want)


def test_named_kernel_never_falls_back(monkeypatch):
  """A kernel named explicitly that cannot run the call (it says why, or its module is
  missing) is a ValueError naming it and the reason; the compiled kernels refuse on CPU."""
  x = _f32(_small_inputs(7))
  args = [x[n] for n in ("q", "k", "v", "beta", "log_alpha", "prior_precision")]
  if jax.default_backend() == "cpu":
    for kernel, reason in (("pallas_gpu", "NVIDIA GPU"), ("pallas_tpu", "needs a TPU")):
      with pytest.raises(ValueError, match=f"implementation='{kernel}' cannot run.*{reason}"):
        palimpsa(*args, implementation=kernel)
  monkeypatch.setitem(implementations.IMPLEMENTATIONS, "pallas_gpu", _declining("test"))
  with pytest.raises(ValueError, match="implementation='pallas_gpu' cannot run this call: test"):
    palimpsa(*args, implementation="pallas_gpu")
  missing = dispatch.unavailable(ImportError("test: no module"))
  monkeypatch.setitem(implementations.IMPLEMENTATIONS, "pallas_gpu", missing)
  with pytest.raises(ValueError, match="'pallas_gpu' cannot run.*cannot be imported: test"):
    palimpsa(*args, implementation="pallas_gpu")


@pytest.mark.parametrize("implementation, kernel", [
    ("pallas_gpu_triton", "triton"), ("pallas_gpu_mosaic", "mosaic"), ("pallas_gpu", "mosaic")])
def test_gpu_backend_is_chosen_at_the_api(monkeypatch, implementation, kernel):
  """`palimpsa(implementation=...)` picks the GPU kernel's Pallas backend: the config that
  reaches the kernel names it for every stage ("pallas_gpu": Mosaic wherever it runs, as
  it does interpreted on one device at these sizes), and the result is Palimpsa's."""
  # Deferred: the GPU kernel's module, spied on here, is optional for the op.
  from pallas_kernels.palimpsa_gpu import op as gpu_op
  seen = []
  original = gpu_op._palimpsa

  def spy(cfg, *args):
    seen.append(cfg)
    return original(cfg, *args)

  monkeypatch.setattr(gpu_op, "_palimpsa", spy)
  x = _small_inputs(3, shape=(1, 32, 1, 16, 16))
  names = ("q", "k", "v", "beta", "log_alpha", "prior_precision")
  out = palimpsa(*(jnp.asarray(x[n], jnp.float32) for n in names),
                 implementation=implementation, chunk_size=16, interpret=True).out
  (cfg,) = seen
  assert cfg.backends == (kernel,) * 4
  with jax.enable_x64(True):
    want = np.asarray(reference_palimpsa(*(jnp.asarray(x[n]) for n in names)).out)
  assert_close_to_reference(out, want, FLOAT32_TOL)


def test_gpu_backend_that_cannot_run_a_stage_names_it():
  """"pallas_gpu_mosaic" where a stage's Mosaic kernel does not take the call (the forward
  walk's K is at most 128) is a ValueError naming the stage, not a silent Triton run."""
  x = _f32(_small_inputs(3, shape=(1, 16, 1, 144, 16)))
  args = [x[n] for n in ("q", "k", "v", "beta", "log_alpha", "prior_precision")]
  with pytest.raises(ValueError, match="mosaic kernel of the forward walk cannot run"):
    palimpsa(*args, implementation="pallas_gpu_mosaic", chunk_size=16, interpret=True)


_NO_GPU_KERNEL = """
import sys
sys.modules["pallas_kernels.palimpsa_gpu"] = None  # Its import now raises ImportError.
import jax.numpy as jnp
from palimpsa_jax.ops import dispatch
from palimpsa_jax.ops.palimpsa import palimpsa
x = jnp.ones((1, 4, 1, 2)) / 2
args = (x, x, x, x, jnp.full((1, 4, 1), -0.1), jnp.ones((1,)))
dispatch.platform = lambda: "cuda"
assert (palimpsa(*args).out == palimpsa(*args, implementation="chunked").out).all()
try:
  palimpsa(*args, implementation="pallas_gpu")
except ValueError as error:
  print("raised:", error)
"""


def test_a_kernel_module_that_cannot_import_is_left_to_auto(run_on_cpu_devices):
  """The table keeps a kernel whose import fails: "auto" runs "chunked", naming it raises."""
  result = run_on_cpu_devices(_NO_GPU_KERNEL, 1)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "raised: implementation='pallas_gpu' cannot run this call: its module cannot be " \
         "imported" in result.stdout

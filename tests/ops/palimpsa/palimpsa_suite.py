"""Shared test suite for every Palimpsa implementation, against the float64 reference.

A test file subclasses `PalimpsaSuite` and sets IMPLEMENTATION (and INTERPRET for Pallas kernels in
interpret mode); the whole suite then reruns for that implementation. The suite is kept small in
test count and shapes because interpreted kernels rerun it on CPU. It is a chex.TestCase, so that
the float32 check runs through chex's variants: jitted on every shape, eagerly (op by op) on one
small shape.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from palimpsa_jax.ops import PalimpsaState, palimpsa
from palimpsa_jax.ops.palimpsa import reference_palimpsa
from tests.ops.numerics import BFLOAT16_TOL, FLOAT32_TOL, GRAD_TOL, assert_close_to_reference

DIFF_ARGS = ("q", "k", "v", "beta", "log_alpha", "prior_precision", "mu0", "precision0")


def make_inputs(seed: int, shape, dtype=jnp.float32, segment_lengths=None) -> dict:
  """Random op inputs (numpy, values already rounded to dtype) plus segment ids.

  shape = (B, T, H, K, V). segment_lengths (per row) packs documents; None: no segment ids.
  """
  b, t, h, kd, vd = shape
  rng = np.random.default_rng(seed)

  def cast(x, dt=dtype):
    return np.asarray(jnp.asarray(x, dt).astype(jnp.float32))

  x = dict(
      q=cast(rng.standard_normal((b, t, h, kd)) / np.sqrt(kd)),
      k=cast(rng.standard_normal((b, t, h, kd)) / np.sqrt(kd)),
      v=cast(rng.standard_normal((b, t, h, vd))),
      beta=cast(rng.uniform(0.0, 1.0, (b, t, h, vd))),
      log_alpha=cast(np.log(rng.uniform(0.6, 1.0, (b, t, h)))),
      prior_precision=cast(rng.uniform(0.5, 2.0, (h,))),
      mu0=cast(rng.standard_normal((b, h, vd, kd)), jnp.float32),
      precision0=cast(rng.uniform(0.5, 3.0, (b, h, vd, kd)), jnp.float32),
  )
  if segment_lengths is not None:
    x["segment_ids"] = np.stack(
        [np.repeat(np.arange(len(row)), row) for row in segment_lengths]).astype(np.int32)
  return x


def _call(fn, x, dtype, **kwargs):
  """Runs an op-shaped fn on the dict x with the float inputs in dtype (state stays f32)."""
  cast = lambda n: jnp.asarray(x[n], dtype)
  return fn(cast("q"), cast("k"), cast("v"), cast("beta"), cast("log_alpha"),
            cast("prior_precision"),
            initial_state=PalimpsaState(jnp.asarray(x["mu0"], jnp.float32),
                                        jnp.asarray(x["precision0"], jnp.float32)),
            segment_ids=None if x.get("segment_ids") is None else jnp.asarray(x["segment_ids"]),
            **kwargs)


def result_and_grads(fn, diff, seg, cotangents):
  """(out, variance, mu, precision) and the grads of <result, cotangents> w.r.t. diff."""

  def flat(*args):
    q, k, v, beta, la, ip, mu0, p0 = args
    r = fn(q, k, v, beta, la, ip, initial_state=PalimpsaState(mu0, p0), segment_ids=seg)
    return (r.out, r.variance, r.state.mu, r.state.precision)

  res, vjp = jax.vjp(flat, *diff)
  cts = tuple(jnp.asarray(c, r.dtype) for c, r in zip(cotangents, res))
  return res, vjp(cts)


def _op_with_grads_fn(diff, seg, cotangents, *, implementation, interpret, chunk_size):
  fn = functools.partial(palimpsa, return_variance=True, implementation=implementation,
                         chunk_size=chunk_size, interpret=interpret)
  return result_and_grads(fn, diff, seg, cotangents)


_STATIC = ("implementation", "interpret", "chunk_size")
_jitted_op_with_grads = jax.jit(_op_with_grads_fn, static_argnames=_STATIC)


@jax.jit
def _reference_with_grads(diff, seg, cotangents):
  return result_and_grads(reference_palimpsa, diff, seg, cotangents)


def reference_with_grads(x, cotangents):
  """float64 reference result and grads, as numpy."""
  with jax.enable_x64(True):
    diff = tuple(jnp.asarray(x[n], jnp.float64) for n in DIFF_ARGS)
    seg = None if x.get("segment_ids") is None else jnp.asarray(x["segment_ids"])
    cts = tuple(jnp.asarray(c, jnp.float64) for c in cotangents)
    return jax.tree.map(np.asarray, _reference_with_grads(diff, seg, cts))


@functools.cache
def _jitted_palimpsa(implementation, interpret, chunk_size, return_variance):
  return jax.jit(functools.partial(palimpsa, implementation=implementation, interpret=interpret,
                                   chunk_size=chunk_size, return_variance=return_variance))


RESULTS = ("out", "variance", "mu", "precision")
GRADS = tuple(f"d{n}" for n in DIFF_ARGS)


def _named(names, arrays) -> dict:
  """A dict pytree, so that chex's messages name each array."""
  return dict(zip(names, arrays))


def random_cotangents(seed, shape):
  b, t, h, kd, vd = shape
  rng = np.random.default_rng(seed)
  return tuple(rng.standard_normal(s) for s in
               ((b, t, h, vd), (b, t, h, vd), (b, h, vd, kd), (b, h, vd, kd)))


class PalimpsaSuite(chex.TestCase):
  """Subclass and set IMPLEMENTATION / INTERPRET (and SHAPES for slow interpreted kernels)."""

  __test__ = False  # pytest collects the subclasses only.

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    cls.__test__ = True

  IMPLEMENTATION: str = "sequential"
  INTERPRET: bool = False
  # (B, T, H, K, V), chunk_size, segment lengths per row (None: no segment ids).
  SHAPES = (
      ((2, 37, 2, 8, 4), 16, ((10, 20, 7), (37,))),  # T not a multiple of the chunk, K != V
      ((1, 1, 2, 4, 4), 64, None),                    # T = 1
      ((1, 64, 1, 16, 16), 16, ((64,),)),             # T a multiple of the chunk
  )
  # The eagerly run case: 3 chunks, a restart inside the first one.
  EAGER_SHAPE = ((1, 9, 1, 4, 3), 4, ((3, 6),))
  LONG_RUN = True  # 100k-step alpha -> 1 run; off for interpreted kernels.

  def op(self, *args, chunk_size, return_variance=False, **kwargs):
    """palimpsa with this suite's implementation, jitted (one compile per static setting)."""
    fn = _jitted_palimpsa(self.IMPLEMENTATION, self.INTERPRET, chunk_size, return_variance)
    return fn(*args, **kwargs)

  def _op_with_grads(self, diff, seg, cotangents, chunk_size, run=_jitted_op_with_grads):
    """(out, variance, mu, precision) and their vjp's grads; `run` is _op_with_grads_fn,
    jitted (default) or under a chex variant."""
    return run(diff, seg, cotangents, implementation=self.IMPLEMENTATION,
               interpret=self.INTERPRET, chunk_size=chunk_size)

  def _check_against_reference(self, seed, shape, chunk, lengths, dtype, fwd_tol, grad_tol,
                               run=_jitted_op_with_grads, label=""):
    x = make_inputs(seed, shape, dtype, lengths)
    cts = random_cotangents(seed + 1, shape)
    diff = tuple(jnp.asarray(x[n], dtype if i < 6 else jnp.float32)
                 for i, n in enumerate(DIFF_ARGS))
    seg = None if lengths is None else jnp.asarray(x["segment_ids"])
    res, grads = self._op_with_grads(diff, seg, cts, chunk, run)
    ref_res, ref_grads = reference_with_grads(x, cts)
    b, t, h, kd, vd = shape
    chex.assert_shape(res, [(b, t, h, vd), (b, t, h, vd), (b, h, vd, kd), (b, h, vd, kd)])
    chex.assert_type(res, [dtype, jnp.float32, jnp.float32, jnp.float32])
    chex.assert_tree_all_finite(grads)
    label = " ".join(filter(None, (str(shape), jnp.dtype(dtype).name, label))) + " "
    assert_close_to_reference(_named(RESULTS, res), _named(RESULTS, ref_res), fwd_tol, label)
    assert_close_to_reference(_named(GRADS, grads), _named(GRADS, ref_grads), grad_tol, label)

  @chex.variants(with_jit=True, without_jit=True)
  def test_float32_matches_reference(self):
    """Jitted: every shape. Eagerly (op by op): EAGER_SHAPE only, to keep CI time."""
    jitted = self.variant.type is chex.ChexVariantType.WITH_JIT
    run = self.variant(_op_with_grads_fn, static_argnames=_STATIC)
    for i, (shape, chunk, lengths) in enumerate(self.SHAPES if jitted else [self.EAGER_SHAPE]):
      self._check_against_reference(10 + i, shape, chunk, lengths, jnp.float32, FLOAT32_TOL,
                                    GRAD_TOL, run, self.variant.type.name.lower())

  def test_bfloat16_matches_reference(self):
    shape, chunk, lengths = self.SHAPES[0]
    self._check_against_reference(20, shape, chunk, lengths, jnp.bfloat16, BFLOAT16_TOL,
                                  BFLOAT16_TOL)

  def test_state_continuation(self):
    shape, chunk, _ = self.SHAPES[0]
    x = make_inputs(30, shape)
    t1 = shape[1] // 2 - 3
    run = lambda y: _call(self.op, y, jnp.float32, chunk_size=chunk, return_variance=True)
    sequences = ("q", "k", "v", "beta", "log_alpha")
    whole = run(x)
    first = run({**x, **{n: x[n][:, :t1] for n in sequences}})
    second = run({**x, **{n: x[n][:, t1:] for n in sequences},
                  "mu0": first.state.mu, "precision0": first.state.precision})
    chex.assert_trees_all_close(
        (jnp.concatenate([first.out, second.out], 1), second.state.mu),
        (whole.out, whole.state.mu), rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(
        (jnp.concatenate([first.variance, second.variance], 1), second.state.precision),
        (whole.variance, whole.state.precision), rtol=1e-5)

  def test_segments_match_separate_runs(self):
    lengths = (5, 11, 8)
    shape = (1, sum(lengths), 2, 4, 3)
    x = make_inputs(40, shape, segment_lengths=(lengths,))
    x.pop("mu0"), x.pop("precision0")
    fields = ("q", "k", "v", "beta", "log_alpha")
    packed = self.op(*(jnp.asarray(x[n]) for n in fields), jnp.asarray(x["prior_precision"]),
                     segment_ids=jnp.asarray(x["segment_ids"]), chunk_size=8,
                     return_variance=True)
    start = 0
    for length in lengths:
      piece = self.op(*(jnp.asarray(x[n][:, start:start + length]) for n in fields),
                      jnp.asarray(x["prior_precision"]), chunk_size=8, return_variance=True)
      chex.assert_trees_all_close(packed.out[:, start:start + length], piece.out,
                                  rtol=1e-5, atol=1e-6)
      chex.assert_trees_all_close(packed.variance[:, start:start + length], piece.variance,
                                  rtol=1e-5)
      start += length
    chex.assert_trees_all_close(packed.state.mu, piece.state.mu, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(packed.state.precision, piece.state.precision, rtol=1e-5)

  def test_corner_cases_finite(self):
    shape = (1, 19, 2, 4, 4)
    corners = {
        "alpha->0": dict(log_alpha=-60.0),
        "beta=1e4": dict(beta=1e4),
        "Ip=1e-4": dict(prior_precision=1e-4),
        "all": dict(log_alpha=-60.0, beta=1e4, prior_precision=1e-4),
    }
    for i, (label, override) in enumerate(corners.items()):
      x = make_inputs(50 + i, shape)
      x.update({n: np.full_like(x[n], val) for n, val in override.items()})
      cts = random_cotangents(60 + i, shape)
      diff = tuple(jnp.asarray(x[n], jnp.float32) for n in DIFF_ARGS)
      res, grads = self._op_with_grads(diff, None, cts, 8)
      ref_res, _ = reference_with_grads(x, cts)
      chex.assert_tree_all_finite(_named(RESULTS + GRADS, res + grads))
      assert_close_to_reference(_named(RESULTS, res), _named(RESULTS, ref_res), 1e-4, label)

  def test_alpha_to_one_for_100k_steps(self):
    if not self.LONG_RUN:
      self.skipTest(f"LONG_RUN = False for {self.IMPLEMENTATION}: the 100k-step run is too "
                    "costly here")
    t = 100_000
    shape = (1, t, 1, 2, 2)
    x = make_inputs(70, shape)
    x["log_alpha"] = np.full_like(x["log_alpha"], -1e-7)
    cts = random_cotangents(71, shape)
    diff = tuple(jnp.asarray(x[n], jnp.float32) for n in DIFF_ARGS)
    res, grads = self._op_with_grads(diff, None, cts, 64)
    chex.assert_tree_all_finite(_named(RESULTS + GRADS, res + grads))
    # Precision accumulates (almost) every write: I_T ~ I_0 + sum_t beta k^2.
    expected = x["precision0"][0, 0] + np.einsum("tv,tk->vk", x["beta"][0, :, 0],
                                                 x["k"][0, :, 0] ** 2)
    chex.assert_trees_all_close(res[3][0, 0], expected, rtol=2e-2)

  def test_jit_vmap_grad_compose(self):
    """jit(vmap(grad)) == per-example grads == float64 grads; also covers no variance."""
    shape = (1, 9, 1, 4, 3)
    xs = [make_inputs(80 + i, shape) for i in range(2)]

    def loss(fn, q, k, v, beta, la, ip):
      r = fn(q, k, v, beta, la, ip)
      return jnp.sum(r.out * r.out) + jnp.sum(r.state.mu) + jnp.sum(jnp.log(r.state.precision))

    names = DIFF_ARGS[:6]
    argnums = tuple(range(6))
    grad = jax.grad(functools.partial(loss, functools.partial(self.op, chunk_size=4)), argnums)
    stacked = [jnp.stack([jnp.asarray(x[n]) for x in xs]) for n in names]
    batched = jax.jit(jax.vmap(grad))(*stacked)
    single_grad = jax.jit(grad)
    ref_grad = jax.jit(jax.grad(functools.partial(loss, reference_palimpsa), argnums))
    for i, x in enumerate(xs):
      single = single_grad(*(jnp.asarray(x[n]) for n in names))
      with jax.enable_x64(True):
        ref = jax.tree.map(np.asarray, ref_grad(*(jnp.asarray(x[n], jnp.float64) for n in names)))
      chex.assert_trees_all_close(tuple(g[i] for g in batched), single, rtol=1e-5, atol=1e-6)
      assert_close_to_reference(_named(names, single), _named(names, ref), GRAD_TOL)

  def test_no_recompilation(self):
    """Fresh inputs of one shape: the jitted op is traced once."""
    chex.clear_trace_counter()
    shape = (1, 11, 2, 4, 4)
    fn = jax.jit(chex.assert_max_traces(
        lambda *a: palimpsa(*a, implementation=self.IMPLEMENTATION, interpret=self.INTERPRET,
                            chunk_size=4).out, n=1))
    for seed in (90, 91, 92):
      x = make_inputs(seed, shape)
      fn(*(jnp.asarray(x[n]) for n in DIFF_ARGS[:6])).block_until_ready()

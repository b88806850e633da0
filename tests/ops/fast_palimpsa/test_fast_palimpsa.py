"""Fast Palimpsa: each implementation against the float64 literal reference, where the
approximation is exact, segments, chunk sizes, continuation and bad input."""

import functools

import chex
import jax
import jax.numpy as jnp
from jax.test_util import check_grads
import numpy as np
import pytest

from palimpsa_jax.ops import PalimpsaState, fast_palimpsa, kernel_sharding, palimpsa
from palimpsa_jax.ops.fast_palimpsa import (fast_palimpsa_decode, init_fast_palimpsa_cache,
                                           reference_fast_palimpsa)
from tests.ops.fast_palimpsa.fast_palimpsa_suite import (GRADS, RESULTS, check_against_reference,
                                                       op_with_grads, reference)
from tests.ops.numerics import (BFLOAT16_TOL, FLOAT32_TOL, GRAD_TOL, assert_close_to_reference,
                                rel_error)
from tests.ops.palimpsa.palimpsa_suite import DIFF_ARGS, make_inputs, random_cotangents

IMPLEMENTATIONS = ("chunked", "sequential")
SEQUENCES = ("q", "k", "v", "beta", "log_alpha")
# (B, T, H, K, V), chunk_size, segment lengths per row (None: no segment ids).
SHAPES = (
    ((2, 37, 2, 8, 4), 16, ((10, 20, 7), (37,))),  # padded last chunk, restarts inside chunks
    ((1, 64, 1, 16, 16), 32, ((16, 48),)),          # a restart on a chunk boundary
    ((1, 45, 2, 4, 8), 64, None),                   # one chunk, longer than T
    ((1, 1, 1, 4, 4), 16, None),                    # T = 1
)


# "sequential" (the reference's loop in float32) on the first two shapes only, for CI time.
CASES = [("chunked", *s) for s in SHAPES] + [("sequential", *s) for s in SHAPES[:2]]


@pytest.mark.parametrize("implementation,shape,chunk,lengths", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_float32_matches_reference(implementation, shape, chunk, lengths):
  check_against_reference(implementation, 10, shape, chunk, lengths, jnp.float32, FLOAT32_TOL,
                          GRAD_TOL)


def test_bfloat16_matches_reference():
  shape, chunk, lengths = SHAPES[0]
  check_against_reference("chunked", 20, shape, chunk, lengths, jnp.bfloat16, BFLOAT16_TOL,
                          BFLOAT16_TOL)


def _args(x, *names):
  return [jnp.asarray(x[n]) for n in names]


@pytest.mark.parametrize("chunk", (4, 16, 64))
def test_exact_when_beta_is_constant_over_v(chunk):
  """beta_t[v] = b_t: the precision never depends on v, so the rank-1 form is the precision
  itself and the op is `palimpsa`, from the prior or from a state whose precision is constant
  over V, with restarts; the grads w.r.t. every input but beta's V-structure agree too."""
  shape = (2, 45, 2, 8, 4)
  x = make_inputs(30, shape, segment_lengths=((7, 30, 8), (45,)))
  x["beta"] = np.broadcast_to(x["beta"][..., :1], x["beta"].shape).copy()
  x["precision0"] = np.broadcast_to(x["precision0"][:, :, :1], x["precision0"].shape).copy()
  seg = jnp.asarray(x["segment_ids"])
  for state in (None, PalimpsaState(*_args(x, "mu0", "precision0"))):

    def loss(op, q, k, v, la, ip):
      r = op(q, k, v, jnp.asarray(x["beta"]), la, ip, initial_state=state, segment_ids=seg,
             return_variance=True)
      return jnp.sum(r.out ** 2) + jnp.sum(r.variance) + jnp.sum(r.state.mu), r

    names = ("q", "k", "v", "log_alpha", "prior_precision")
    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3, 4, 5), has_aux=True), static_argnums=0)
    approx = grad(functools.partial(fast_palimpsa, chunk_size=chunk), *_args(x, *names))
    exact = grad(palimpsa, *_args(x, *names))
    assert_close_to_reference(approx[1], exact[1], FLOAT32_TOL)
    assert_close_to_reference(approx[0], exact[0], GRAD_TOL)


def test_grads_exact_when_beta_k2_is_constant_over_v_and_k():
  """beta_t[v] = b_t and |k_t[i]| = c_t: Ibar_K is constant over K, so a change of beta
  moves the rank-1 form exactly as it moves the precision: dbeta agrees as well."""
  shape = (1, 40, 2, 4, 3)
  x = make_inputs(38, shape)
  x["beta"] = np.broadcast_to(x["beta"][..., :1], x["beta"].shape).copy()
  x["k"] = np.sign(x["k"]) * np.abs(x["k"][..., :1])

  def loss(op, *args):
    r = op(*args)
    return jnp.sum(r.out * jnp.asarray(x["v"][..., ::-1])), r.out

  grad = jax.jit(jax.grad(loss, argnums=tuple(range(1, 7)), has_aux=True), static_argnums=0)
  args = _args(x, *DIFF_ARGS[:6])
  approx = grad(functools.partial(fast_palimpsa, chunk_size=16), *args)
  exact = grad(palimpsa, *args)
  assert_close_to_reference(approx[1], exact[1], FLOAT32_TOL)
  assert_close_to_reference(dict(zip(GRADS, approx[0])), dict(zip(GRADS, exact[0])), GRAD_TOL)


def test_beta_none_is_the_exact_op():
  x = make_inputs(31, (1, 40, 2, 4, 4))
  args = _args(x, "q", "k", "v")
  rest = _args(x, "log_alpha", "prior_precision")
  run = jax.jit(lambda op: op(*args, None, *rest, return_variance=True), static_argnums=0)
  assert_close_to_reference(run(fast_palimpsa), run(palimpsa), FLOAT32_TOL)


def test_is_an_approximation_where_beta_varies_over_v():
  """With beta varying over V the output differs from `palimpsa` (the state does not)."""
  x = make_inputs(32, (1, 64, 2, 8, 8))
  args = _args(x, "q", "k", "v", "beta", "log_alpha", "prior_precision")
  approx, exact = jax.jit(fast_palimpsa)(*args), jax.jit(palimpsa)(*args)
  assert rel_error(approx.out, exact.out) > 1e-3
  assert_close_to_reference(approx.state, exact.state, FLOAT32_TOL)


@pytest.mark.parametrize("chunk", (16, 32, 64))
def test_chunk_size_at_least_t_is_one_chunk(chunk):
  """A chunk_size >= T is one chunk: the same as chunk_size = T."""
  x = make_inputs(33, (1, 16, 2, 4, 4))
  args = _args(x, "q", "k", "v", "beta", "log_alpha", "prior_precision")
  op = jax.jit(fast_palimpsa, static_argnames="chunk_size")
  chex.assert_trees_all_close(op(*args, chunk_size=chunk), op(*args, chunk_size=16),
                              rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_continuation_at_a_chunk_boundary(implementation):
  """Split at a multiple of C and carry the (exact) state: the same outputs and state."""
  x = make_inputs(34, (2, 40, 2, 4, 3))
  op = jax.jit(functools.partial(fast_palimpsa, chunk_size=8, return_variance=True,
                                 implementation=implementation))
  ip = jnp.asarray(x["prior_precision"])
  whole = op(*_args(x, *SEQUENCES), ip)
  first = op(*(jnp.asarray(x[n][:, :16]) for n in SEQUENCES), ip)
  second = op(*(jnp.asarray(x[n][:, 16:]) for n in SEQUENCES), ip, initial_state=first.state)
  chex.assert_trees_all_close(
      (jnp.concatenate([first.out, second.out], 1),
       jnp.concatenate([first.variance, second.variance], 1), second.state),
      (whole.out, whole.variance, whole.state), rtol=1e-5, atol=1e-6)


def test_a_document_starting_on_a_chunk_boundary_matches_its_own_run():
  """Restarts cut everything before them off: a packed document that starts at a multiple of
  C gets the outputs of the same document run alone."""
  lengths = (16, 24)
  x = make_inputs(35, (1, 40, 2, 4, 3), segment_lengths=(lengths,))
  ip = jnp.asarray(x["prior_precision"])
  op = jax.jit(functools.partial(fast_palimpsa, chunk_size=8))
  packed = op(*_args(x, *SEQUENCES), ip, segment_ids=jnp.asarray(x["segment_ids"]))
  alone = op(*(jnp.asarray(x[n][:, 16:]) for n in SEQUENCES), ip)
  chex.assert_trees_all_close((packed.out[:, 16:], packed.state), (alone.out, alone.state),
                              rtol=1e-5, atol=1e-6)


def test_corner_cases_finite():
  shape = (1, 19, 2, 4, 4)
  for i, override in enumerate((dict(log_alpha=-60.0), dict(beta=1e4),
                                dict(prior_precision=1e-4))):
    x = make_inputs(50 + i, shape)
    x.update({n: np.full_like(x[n], val) for n, val in override.items()})
    cts = random_cotangents(60 + i, shape)
    diff = tuple(jnp.asarray(x[n], jnp.float32) for n in DIFF_ARGS)
    res, grads = op_with_grads(diff, None, cts, "chunked", 8)
    chex.assert_tree_all_finite((res, grads))
    ref_res, _ = reference(x, cts, 8)
    assert_close_to_reference(dict(zip(RESULTS, res)), dict(zip(RESULTS, ref_res)), 1e-4,
                              str(override))


def test_reference_gradients_check_numerically():
  x = make_inputs(36, (1, 7, 1, 3, 2), segment_lengths=((3, 4),))
  seg = jnp.asarray(x["segment_ids"])
  with jax.enable_x64(True):
    def fn(q, k, v, beta, log_alpha, prior_precision):
      r = reference_fast_palimpsa(q, k, v, beta, log_alpha, prior_precision, segment_ids=seg,
                                  chunk_size=2)
      return r.out, r.variance, r.state.mu, r.state.precision

    check_grads(fn, [jnp.asarray(x[n], jnp.float64) for n in DIFF_ARGS[:6]], order=1,
                modes=("rev",))


def _bad_cases():
  x = make_inputs(37, (2, 13, 2, 4, 3), segment_lengths=((13,), (5, 8)))
  b, t, h, kd, vd = 2, 13, 2, 4, 3
  state = PalimpsaState(jnp.zeros((b, h, vd, kd)), jnp.ones((b, h, vd, kd)))
  return x, [
      ("q", ValueError, dict(q=x["q"][0])),
      ("beta", ValueError, dict(beta=x["beta"][..., :-1])),
      ("log_alpha", ValueError, dict(log_alpha=x["log_alpha"][..., None])),
      ("prior_precision", ValueError, dict(prior_precision=np.ones((h, kd)))),
      ("v", TypeError, dict(v=x["v"].astype(np.int32))),
      ("segment_ids", ValueError, dict(segment_ids=x["segment_ids"][:, :-1])),
      ("initial_state", TypeError, dict(initial_state=tuple(state))),
      ("initial_state.precision", ValueError,
       dict(initial_state=state._replace(precision=state.precision[0]))),
      ("implementation", ValueError, dict(implementation="triton")),
      ("chunk_size", ValueError, dict(chunk_size=0)),
      ("chunk_size", TypeError, dict(chunk_size=16.0)),
  ]


@pytest.mark.parametrize("case", range(len(_bad_cases()[1])))
def test_bad_input_names_the_argument(case):
  x, cases = _bad_cases()
  name, error, override = cases[case]
  x = {n: jnp.asarray(a) for n, a in x.items()}
  x.update(override)
  options = {n: x.pop(n) for n in ("initial_state", "implementation", "chunk_size") if n in x}
  with pytest.raises(error, match=name):
    fast_palimpsa(*(x[n] for n in DIFF_ARGS[:6]), segment_ids=x["segment_ids"], **options)


def test_decoding_in_pieces_matches_the_whole_sequence():
  """A prompt in pieces that straddle chunk boundaries, then single tokens, from a given state:
  the outputs and the exact state of `fast_palimpsa` on the whole sequence."""
  x = make_inputs(39, (2, 30, 2, 4, 3))
  ip = jnp.asarray(x["prior_precision"])
  state = PalimpsaState(*_args(x, "mu0", "precision0"))
  whole = jax.jit(functools.partial(fast_palimpsa, chunk_size=8))(
      *_args(x, *SEQUENCES), ip, initial_state=state)
  decode = jax.jit(functools.partial(fast_palimpsa_decode, chunk_size=8))
  cache, outs, start = init_fast_palimpsa_cache(state), [], 0
  for length in (5, 13, 1, 1, 10):
    out, cache = decode(*(jnp.asarray(x[n][:, start:start + length]) for n in SEQUENCES), ip,
                        cache)
    outs.append(out)
    start += length
  chex.assert_trees_all_close((jnp.concatenate(outs, 1), cache.state),
                              (whole.out, whole.state), rtol=1e-5, atol=1e-6)


def test_refuses_a_sequence_split_over_devices():
  x = make_inputs(40, (1, 8, 1, 4, 4))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sequence",))
  with kernel_sharding.kernel_sharding(mesh, (), (), "sequence"):
    with pytest.raises(ValueError, match="cannot split the sequence over devices"):
      fast_palimpsa(*_args(x, *DIFF_ARGS[:6]))

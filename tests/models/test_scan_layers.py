"""config.scan_layers: one stacked, scanned block computes what the unrolled blocks do."""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from palimpsa_jax.models import TRAIN_STEP_COMPILER_OPTIONS, build_model, model_config
from palimpsa_jax.models.language_model import REMAT_SAVES
from palimpsa_jax.training import sharding as sharding_lib
from tests.ops.numerics import assert_close_to_reference

NUM_LAYERS, BATCH, LENGTH = 3, 2, 12


def scanned_and_unrolled(model: str):
  """(scanned model, unrolled model holding the same parameters, config)."""
  config = model_config(model, "tiny", dtype="float32", num_layers=NUM_LAYERS,
                        chunk_size=4)
  scanned_config = config.copy_and_resolve_references()
  scanned_config.scan_layers = True
  scanned = build_model(scanned_config, nnx.Rngs(0))
  unrolled = build_model(config, nnx.Rngs(1))
  for block, layer in zip(unrolled.blocks, scanned.layer_blocks()):
    nnx.update(block, nnx.state(layer))
  unrolled.embed[...] = scanned.embed[...]
  nnx.update(unrolled.final_norm, nnx.state(scanned.final_norm))
  return scanned, unrolled, scanned_config


def tokens_for(config, seed=0):
  return jax.random.randint(jax.random.key(seed), (BATCH, LENGTH), 0,
                            config.vocab_size)


@pytest.mark.parametrize("model", ["palimpsa_d", "mamba2", "gated_deltanet",
                                   "transformer"])
def test_scanned_forward_and_gradients_equal_unrolled(model):
  scanned, unrolled, config = scanned_and_unrolled(model)
  tokens = tokens_for(config)
  segments = jnp.asarray([[0] * 5 + [1] * 7, [0] * LENGTH], jnp.int32)

  def loss(m):
    logits = m(tokens, segment_ids=segments)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 1])

  value_s, grads_s = nnx.jit(nnx.value_and_grad(loss))(scanned)
  value_u, grads_u = nnx.jit(nnx.value_and_grad(loss))(unrolled)
  chex.assert_trees_all_close(value_s, value_u, rtol=1e-6)
  stacked = nnx.to_pure_dict(grads_s)["blocks"]
  for i, layer in nnx.to_pure_dict(grads_u)["blocks"].items():
    chex.assert_trees_all_close(jax.tree.map(lambda s, i=i: s[i], stacked), layer,
                                rtol=1e-4, atol=1e-7)
  # The embedding's gradient reaches 0.5, where float32 numbers are 6e-8 apart: the two
  # compilations' sums in other orders differ by a few of those (up to 3e-7 measured) at
  # entries near zero too, which atol 1e-7 sat on the edge of.
  chex.assert_trees_all_close(nnx.to_pure_dict(grads_s)["embed"],
                              nnx.to_pure_dict(grads_u)["embed"], rtol=1e-4, atol=1e-6)


def test_scanned_diagnostics_are_per_layer_and_remat_keeps_the_gradients():
  scanned, unrolled, config = scanned_and_unrolled("palimpsa_d")
  tokens = tokens_for(config)
  _, diag_s = scanned(tokens, return_diagnostics=True)
  _, diag_u = unrolled(tokens, return_diagnostics=True)
  assert len(diag_s) == NUM_LAYERS
  for layer_s, layer_u in zip(diag_s, diag_u):
    assert sorted(layer_s) == sorted(layer_u)
    chex.assert_trees_all_close(layer_s, layer_u, rtol=1e-5, atol=1e-7)
  grad = nnx.jit(nnx.grad(lambda m: jnp.mean(m(tokens))))
  plain = nnx.to_pure_dict(grad(scanned))
  scanned.remat = True
  chex.assert_trees_all_close(nnx.to_pure_dict(grad(scanned)), plain, rtol=1e-5, atol=1e-8)


# CI runs the default policy and the one the 760M config ships with; the others are the same
# check (about 20 s each on two cores) and run with -m slow.
_CI_SAVES = ("nothing", "matmuls_readouts_and_states")


@pytest.mark.parametrize("saves", [
    pytest.param(saves, marks=() if saves in _CI_SAVES else pytest.mark.slow)
    for saves in sorted(REMAT_SAVES)])
def test_every_remat_policy_keeps_the_gradients(saves):
  scanned, _, config = scanned_and_unrolled("palimpsa_d")
  tokens = tokens_for(config)
  grad = nnx.jit(nnx.grad(lambda m: jnp.mean(m(tokens))))
  plain = nnx.to_pure_dict(grad(scanned))
  scanned.remat, scanned.remat_policy = True, REMAT_SAVES[saves]
  chex.assert_trees_all_close(nnx.to_pure_dict(grad(scanned)), plain, rtol=1e-5, atol=1e-8)


def saved_shapes(model, capsys) -> list[tuple[int, ...]]:
  """The shapes of what the backward of mean(model(tokens)) keeps from the forward."""
  graphdef, state = nnx.split(model)
  tokens = jnp.zeros((BATCH, LENGTH), jnp.int32)
  capsys.readouterr()
  print_saved_residuals(lambda state: jnp.mean(nnx.merge(graphdef, state)(tokens)), state)
  lines = capsys.readouterr().out.splitlines()
  return [tuple(int(n) for n in line.split("[")[1].split("]")[0].split(",") if n)
          for line in lines if "from the argument" not in line and "[" in line]


def test_remat_policies_keep_what_they_name(capsys):
  scanned, _, config = scanned_and_unrolled("palimpsa_d")
  scanned.remat = True
  kept = {}
  for saves, policy in REMAT_SAVES.items():
    scanned.remat_policy = policy
    kept[saves] = saved_shapes(scanned, capsys)
  readout = (NUM_LAYERS, BATCH, LENGTH, config.num_heads, config.head_v_dim)
  assert len(kept["matmuls"]) > len(kept["nothing"])
  assert readout not in kept["matmuls"]
  assert readout in kept["matmuls_and_readouts"]


def test_scanned_decoding_equals_forward():
  scanned, _, config = scanned_and_unrolled("palimpsa_d")
  tokens = tokens_for(config, seed=2)
  logits = scanned(tokens)
  cache = scanned.init_cache(BATCH, LENGTH)
  assert len(cache) == NUM_LAYERS
  out, cache = scanned.prefill(tokens[:, :5], cache)
  outputs = [out]
  for t in range(5, LENGTH):
    out, cache = scanned.step(tokens[:, t:t + 1], cache)
    outputs.append(out)
  assert_close_to_reference(jnp.concatenate(outputs, axis=1), logits, 1e-4)


def test_stacked_parameters_carry_the_layers_axis():
  scanned, _, _ = scanned_and_unrolled("palimpsa_d")
  kernel = scanned.blocks.mixer.q_proj.kernel
  assert kernel.shape[0] == NUM_LAYERS
  names = kernel.get_metadata()["out_sharding"]
  assert names[0] == "layers"
  mesh = jax.make_mesh((1, 1, 1, 1), sharding_lib.MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * 4)
  spec = sharding_lib.logical_to_spec(names, kernel.shape, mesh,
                                      sharding_lib.DEFAULT_RULES)
  assert spec[0] is None and len(spec) == kernel.ndim


def test_logits_at_positions_and_their_shape_check():
  scanned, _, config = scanned_and_unrolled("mamba2")
  tokens = tokens_for(config)
  positions = jnp.asarray([[0, 3, 11], [2, 2, 5]], jnp.int32)
  full = scanned(tokens)
  chex.assert_trees_all_close(scanned(tokens, positions=positions),
                              jnp.take_along_axis(full, positions[..., None], axis=1),
                              rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="positions must be"):
    scanned(tokens, positions=positions[0])


def test_scan_layers_rejects_mixed_layers():
  config = model_config("not_palimpsa", "tiny", num_layers=NUM_LAYERS,
                        scan_layers=True, metaplastic_layers=(1,))
  with pytest.raises(ValueError, match="scan_layers=True needs every layer"):
    build_model(config, nnx.Rngs(0))


@pytest.mark.gpu
@pytest.mark.parametrize("remat", [False, True])
def test_train_step_compiler_options_keep_the_gradients(remat):
  """TRAIN_STEP_COMPILER_OPTIONS drops the zero fill of the scan's stacked residuals: the
  compiled GPU step must give bit for bit the gradients of a compile without it (and its
  HLO must have dropped a fill, else the option no longer does anything). The embedding's
  gradient is the exception: a scatter-add over the tokens, whose atomic adds on a GPU run
  in no fixed order, so two runs of one compile may differ in its last bits."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  config = model_config("palimpsa_d", "tiny", dtype="bfloat16", num_layers=NUM_LAYERS,
                        scan_layers=True, remat=remat, implementation="pallas_gpu")
  model = build_model(config, nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(1), (2, 256), 0, config.vocab_size)

  def grads(params):
    loss = lambda p: jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, p)(tokens))[..., 1])
    return jax.grad(loss)(params)

  plain = jax.jit(grads).lower(params).compile()
  lean = jax.jit(grads, compiler_options=TRAIN_STEP_COMPILER_OPTIONS).lower(params).compile()
  assert "AllocateBuffer" in lean.as_text() and "AllocateBuffer" not in plain.as_text()
  got, want = nnx.to_pure_dict(lean(params)), nnx.to_pure_dict(plain(params))
  # A few float32 ulps of gradients near 0.1 (the order of the adds); a changed gradient
  # would be off by far more.
  chex.assert_trees_all_close(got.pop("embed"), want.pop("embed"), rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_equal(got, want)

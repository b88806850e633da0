"""Language model: embedding, mixer blocks, final norm, tied head."""

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from palimpsa_jax.layers import READOUT, KVCache, RMSNorm, SwiGLU
from palimpsa_jax.layers import params as params_lib
from palimpsa_jax.models import config as config_lib
from palimpsa_jax.models import registry
from palimpsa_jax.ops.token_loss import TokenLoss, head_logits, token_loss

# Logical name of the stacked layer axis of config.scan_layers models.
LAYERS_AXIS = "layers"
# config.remat_saves -> what a rematerialised block keeps from its forward pass; the
# rest is recomputed in the backward. "nothing": only the block's input. "matmuls":
# also every matmul's output (its dots without batch dimensions). "matmuls_and_readouts":
# also each mixer's readout (layers.READOUT); a Pallas op's forward kernels still run
# again, for its custom-VJP residuals. "matmuls_readouts_and_states": also what the
# backward needs of any Pallas kernel's outputs (the Palimpsa op's final states), so no
# forward kernel runs twice; only elementwise work and layout copies are recomputed
# (docs/activation_memory.md). Names inside a custom VJP's forward rule are
# not seen by a policy (jax 0.11.2), so the kernels are told apart by their primitive.
_DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
_READOUTS = jax.checkpoint_policies.save_only_these_names(READOUT)
# A Pallas kernel's primitive: pallas_call (pl.pallas_call, the Triton kernels) or mpmd_map
# (plgpu.kernel, the Mosaic GPU kernels), which jax 0.11.2 binds inside a custom_vmap_call:
# the policy sees that call, not the kernel in it.
_KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")


def _kernel_outputs_saveable(primitive, *_, **params) -> bool:
  if primitive.name in _KERNEL_PRIMITIVES:
    return True
  return primitive.name == "custom_vmap_call" and any(
      eqn.primitive.name in _KERNEL_PRIMITIVES for eqn in params["call"].jaxpr.eqns)


REMAT_SAVES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "matmuls": _DOTS,
    "matmuls_and_readouts": jax.checkpoint_policies.save_from_both_policies(_DOTS, _READOUTS),
    "matmuls_readouts_and_states": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_from_both_policies(_DOTS, _READOUTS),
        _kernel_outputs_saveable),
}

# XLA options for a compiled train step of these models. A scan over layers (and any loop
# that stacks its outputs) writes every slot of each stacked array; XLA (jax 0.11.2) still
# fills the array with zeros first unless asked to drop that dead fill, which otherwise
# wrote every stacked residual once more (docs/gpu_performance.md, "The layer around the
# op"). Other backends ignore it.
TRAIN_STEP_COMPILER_OPTIONS = {"xla_gpu_enable_dus_accumulator_zero_init_elimination": True}


def metaplastic_layers(config: ml_collections.ConfigDict) -> tuple[int, ...]:
  """Sorted indices of the layers whose mixer is metaplastic under `config`.

  Every layer when config.metaplasticity, else config.metaplastic_layers.

  Raises:
    ValueError: config.metaplastic_layers holds repeats or indices outside
      [0, num_layers), or is set for a mixer without metaplasticity.
  """
  listed = [int(i) for i in config.metaplastic_layers]
  if listed and not registry.kind(config).metaplastic:
    metaplastic = tuple(name for name, kind in registry.KINDS.items() if kind.metaplastic)
    raise ValueError(
        f"config.metaplastic_layers={listed} needs a mixer in "
        f"{metaplastic}, got config.mixer={config.mixer!r}")
  if len(set(listed)) != len(listed):
    raise ValueError(f"config.metaplastic_layers={listed} contains repeats")
  outside = [i for i in listed if not 0 <= i < config.num_layers]
  if outside:
    raise ValueError(
        f"config.metaplastic_layers={listed}: indices {outside} are outside "
        f"[0, num_layers={config.num_layers})")
  if config.metaplasticity:
    return tuple(range(config.num_layers))
  return tuple(sorted(listed))


class Block(nnx.Module):
  """h + mixer(norm(h)), then h + SwiGLU(norm(h)) when the block has an MLP."""

  def __init__(self, config: ml_collections.ConfigDict, rngs: nnx.Rngs,
               metaplasticity: bool | None = None):
    dtype = jnp.dtype(config.dtype)
    self.mixer_norm = RMSNorm(config.d_model, eps=config.norm_eps, dtype=dtype)
    self.mixer = registry.make_mixer(config, rngs, metaplasticity)
    if config.mlp_hidden_dim:
      self.mlp_norm = RMSNorm(config.d_model, eps=config.norm_eps,
                              dtype=dtype)
      self.mlp = SwiGLU(config.d_model, config.mlp_hidden_dim, rngs=rngs,
                        init_std=config.init_std, dtype=dtype)
    else:
      self.mlp_norm = self.mlp = None

  def __call__(self, h: jax.Array, segment_ids: jax.Array | None,
               return_diagnostics: bool):
    """h [B, T, d] residual stream -> (h, diagnostics dict or None)."""
    out = self.mixer(self.mixer_norm(h), segment_ids=segment_ids,
                     return_diagnostics=return_diagnostics)
    out, diagnostics = out if return_diagnostics else (out, None)
    return self._mlp(h, out), diagnostics

  def prefill(self, h: jax.Array, cache: Any, single_step: bool = False):
    """Runs h [B, T, d] from the mixer's cache -> (h, new cache)."""
    mixer_call = self.mixer.step if single_step else self.mixer.prefill
    out, cache = mixer_call(self.mixer_norm(h), cache)
    return self._mlp(h, out), cache

  def _mlp(self, h, out):
    """h + out, then its SwiGLU branch added: h [B, T, d] the block's input, out the
    mixer's output in the compute dtype."""
    mid = h + out.astype(h.dtype)
    if self.mlp is None:
      return mid
    # The backward keeps h (kept anyway for the mixer's norm) and out, and recomputes their
    # sum and its norm: neither the sum (float32 with residual_in_fp32) nor the norm's
    # output is kept; gate_proj and up_proj do not run again.
    project = lambda h, out: self.mlp.project(self.mlp_norm(h + out.astype(h.dtype)))
    gate, up = jax.checkpoint(project)(h, out)
    return mid + self.mlp.output(gate, up).astype(h.dtype)


class LanguageModel(nnx.Module):
  """Decoder-only LM with a head tied to the token embedding.

  Parameters are float32; compute runs in config.dtype; the residual stream
  is float32 when config.residual_in_fp32; logits are float32. The mixers of
  metaplastic_layers(config) are metaplastic, the others are not.

  With config.scan_layers, `blocks` is one Block whose variables carry a
  leading [num_layers] axis and the forward pass is an nnx.scan over it: XLA
  compiles one layer body instead of num_layers copies (compile time no longer
  grows with depth), which needs every layer alike. Decoding and
  layer_blocks() work on per-layer slices.
  """

  def __init__(self, config: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    config_lib.validate(config)
    metaplastic = metaplastic_layers(config)
    self.embed = params_lib.make_param(
        params_lib.normal_init(config.init_std)(
            rngs.params(), (config.vocab_size, config.d_model)),
        ("vocab", "embed"))
    self.num_layers = config.num_layers
    self.scan_layers = config.scan_layers
    flags = [i in metaplastic if registry.kind(config).metaplastic else None
             for i in range(config.num_layers)]
    if self.scan_layers:
      if len(set(flags)) > 1:
        raise ValueError(
            "config.scan_layers=True needs every layer's mixer alike, but "
            f"config.metaplastic_layers={tuple(config.metaplastic_layers)} makes "
            f"layers {list(metaplastic)} of {config.num_layers} metaplastic; "
            "set config.scan_layers=False")
      self.blocks = _stacked_blocks(config, rngs, flags[0])
    else:
      self.blocks = nnx.List([Block(config, rngs, metaplasticity=flag)
                              for flag in flags])
    self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps,
                              dtype=jnp.dtype(config.dtype))
    self.vocab_size = config.vocab_size
    self.dtype = jnp.dtype(config.dtype)
    self.residual_dtype = (jnp.dtype(jnp.float32) if config.residual_in_fp32
                           else self.dtype)
    self.remat = config.remat
    saves = config.remat_saves
    if saves not in REMAT_SAVES:
      raise ValueError(f"config.model.remat_saves must be one of {sorted(REMAT_SAVES)}, "
                       f"got {saves!r}")
    self.remat_policy = REMAT_SAVES[saves]
    self.matmul_algorithm = config_lib.MATMUL_PRECISIONS[config.matmul_precision]

  def _matmul_precision(self):
    """The context the forward pass is traced in: config.matmul_precision's algorithm
    for every matmul that names no precision of its own (their gradients included)."""
    if self.matmul_algorithm is None:
      return contextlib.nullcontext()
    return jax.default_matmul_precision(self.matmul_algorithm)

  def layer_blocks(self) -> list[Block]:
    """The blocks in layer order; views of one layer's slice when scanned."""
    if not self.scan_layers:
      return list(self.blocks)
    graphdef, state = nnx.split(self.blocks)
    return [nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], state))
            for i in range(self.num_layers)]

  def _check_tokens(self, tokens: jax.Array) -> None:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(
          f"tokens must be [B, T] integers, got {tokens.shape} {tokens.dtype}")

  def _embed(self, tokens):
    self._check_tokens(tokens)
    return jnp.take(self.embed[...], tokens, axis=0).astype(
        self.residual_dtype)

  def _logits(self, h):
    return head_logits(self.final_norm(h), self.embed[...].astype(self.dtype))

  def __call__(self, tokens: jax.Array, *,
               segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None,
               return_diagnostics: bool = False):
    """tokens [B, T] int -> logits [B, T, vocab] f32.

    With positions [B, P] int, only the logits at those positions are
    computed: [B, P, vocab] (a loss that reads few positions, as MQAR's
    queries, skips the rest of the vocabulary projection). With
    return_diagnostics, also a list with each block's mixer diagnostics.
    """
    with self._matmul_precision():
      h, diagnostics = self._hidden(tokens, segment_ids, positions, return_diagnostics)
      logits = self._logits(h)
    return (logits, diagnostics) if return_diagnostics else logits

  def token_losses(self, tokens: jax.Array, targets: jax.Array,
                   weights: jax.Array | None = None, *,
                   segment_ids: jax.Array | None = None,
                   positions: jax.Array | None = None) -> TokenLoss:
    """The next-token loss of __call__'s logits, without the whole logits in memory.

    Args:
      tokens: [B, T] int.
      targets: [B, T] int, or [B, P] with positions: the targets there.
      weights: bool mask or non-negative floats of targets' shape: the targets that count
        (None: all); the token_loss op's argument.
      segment_ids: [B, T] int or None, as in __call__.
      positions: [B, P] int or None, as in __call__.

    Returns:
      ops.token_loss.TokenLoss: per-position nll and argmax hits [B, T or P], and their
      weighted sums, from the final hidden states and the tied embedding.
    """
    with self._matmul_precision():
      h, _ = self._hidden(tokens, segment_ids, positions, False)
      if targets.shape != h.shape[:2]:
        raise ValueError(
            f"targets must be [B, {'P' if positions is not None else 'T'}] = "
            f"{h.shape[:2]}, got {targets.shape}")
      return token_loss(self.final_norm(h), self.embed[...].astype(self.dtype), targets,
                        weights)

  def _hidden(self, tokens, segment_ids, positions, return_diagnostics):
    """The residual stream after the last block (at positions, if given) and the
    blocks' diagnostics."""
    if segment_ids is not None and segment_ids.shape != tokens.shape:
      raise ValueError(
          f"segment_ids must be [B, T] = {tokens.shape}, got "
          f"{segment_ids.shape}")
    if positions is not None and (positions.ndim != 2
                                  or positions.shape[0] != tokens.shape[0]):
      raise ValueError(
          f"positions must be [B, P] with B = {tokens.shape[0]}, got "
          f"{positions.shape}")
    h = self._embed(tokens)

    def run(block, h):
      return block(h, segment_ids, return_diagnostics)

    if self.remat:
      run = nnx.remat(run, policy=self.remat_policy)
    if self.scan_layers:
      h, stacked = nnx.scan(
          lambda h, block: run(block, h), in_axes=(nnx.Carry, 0),
          out_axes=(nnx.Carry, 0),
          transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS})(h, self.blocks)
      diagnostics = [jax.tree.map(lambda x, i=i: x[i], stacked)
                     for i in range(self.num_layers)]
    else:
      diagnostics = []
      for block in self.blocks:
        h, diag = run(block, h)
        diagnostics.append(diag)
    if positions is not None:
      h = take_positions(h, positions)
    return h, diagnostics

  def init_cache(self, batch_size: int, max_length: int,
                 dtype=None) -> tuple[Any, ...]:
    """One fixed-shape cache per block (dtype: KV cache dtype)."""
    dtype = dtype or self.dtype
    return tuple(block.mixer.init_cache(batch_size, max_length, dtype)
                 for block in self.layer_blocks())

  def prefill(self, tokens: jax.Array, cache: tuple[Any, ...]):
    """tokens [B, T] from the cache -> (logits [B, T, vocab] f32, cache).

    Raises ValueError when T exceeds a KV cache's length (init_cache's
    max_length).
    """
    lengths = [c.k.shape[1] for c in cache if isinstance(c, KVCache)]
    if lengths and tokens.shape[1] > min(lengths):
      raise ValueError(
          f"tokens has {tokens.shape[1]} positions, more than the KV cache's "
          f"{min(lengths)} (init_cache's max_length)")
    return self._decode(tokens, cache, single_step=False)

  def step(self, tokens: jax.Array, cache: tuple[Any, ...]):
    """One token per sequence [B, 1] -> (logits [B, 1, vocab] f32, cache).

    A KV cache must have room for the token; under jit its position is traced
    and not checked (see layers.attention.check_cache_room).
    """
    if tokens.ndim != 2 or tokens.shape[1] != 1:
      raise ValueError(f"tokens must be [B, 1], got {tokens.shape}")
    return self._decode(tokens, cache, single_step=True)

  def _decode(self, tokens, cache, single_step):
    if len(cache) != self.num_layers:
      raise ValueError(
          f"cache has {len(cache)} entries, the model {self.num_layers} "
          "blocks")
    with self._matmul_precision():
      h = self._embed(tokens)
      new_cache = []
      for block, block_cache in zip(self.layer_blocks(), cache):
        h, block_cache = block.prefill(h, block_cache, single_step)
        new_cache.append(block_cache)
      return self._logits(h), tuple(new_cache)


def take_positions(x: jax.Array, positions: jax.Array) -> jax.Array:
  """x [B, T, ...] at positions [B, P] int -> [B, P, ...], exactly.

  A one-hot select-and-sum rather than a gather: with take_along_axis along
  the sequence and the batch sharded over the data and fsdp axes of a 2x2x2
  mesh, XLA's SPMD partitioner gave gradients that differ from the one-device
  run (jax 0.11.2; caught by the trainer's 8-fake-device test, also with a
  vmapped gather). float32 x goes through `_select_float32`.
  """
  hit = positions[..., None] == jnp.arange(x.shape[1])  # [B, P, T]
  if jnp.issubdtype(x.dtype, jnp.integer):
    hit = hit.reshape(hit.shape + (1,) * (x.ndim - 2))
    return jnp.sum(jnp.where(hit, x[:, None], 0), axis=2, dtype=x.dtype)
  if x.dtype == jnp.float32:
    return _select_float32(x, positions)
  # bfloat16 is exact as it is; float64 (tests) at its full precision.
  return jnp.einsum("bpt,bt...->bp...", hit.astype(x.dtype), x,
                    precision=jax.lax.Precision.HIGHEST)


def _bfloat16_pieces(x: jax.Array) -> jax.Array:
  """[3, *x.shape] bfloat16 whose float32 sum, first two first, is float32 x exactly.

  hi is x rounded to bfloat16's 8 significant bits; x - hi then has at most 16, and after
  taking mid off, at most 8: every piece and every partial sum is exact for magnitudes from
  2^-96 (below, the last piece may lose bits, an error under 2^-120).
  """
  hi = x.astype(jnp.bfloat16)
  rest = x - hi.astype(jnp.float32)
  mid = rest.astype(jnp.bfloat16)
  return jnp.stack([hi, mid, (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)])


def _one_hot_matmul(subscripts: str, hit: jax.Array, x: jax.Array) -> jax.Array:
  """einsum(subscripts, hit, x) for a one-hot hit and float32 x, exactly: one bfloat16
  matmul of its pieces (tensor cores on a GPU, accumulated in float32), summed."""
  out = jnp.einsum(subscripts, hit.astype(jnp.bfloat16), _bfloat16_pieces(x),
                   preferred_element_type=jnp.float32)
  return (out[0] + out[1]) + out[2]


@jax.custom_vjp
def _select_float32(x: jax.Array, positions: jax.Array) -> jax.Array:
  """take_positions of float32 x, forward and backward as bfloat16 matmuls (tensor cores on a
  GPU). A single float32 matmul at full precision, its earlier form, runs on the GPU's CUDA
  cores (kernels named *gemm_f32f32_f32f32* in `benchmarks.step.profile --mqar`'s table)."""
  hit = positions[..., None] == jnp.arange(x.shape[1])
  return _one_hot_matmul("bpt,sbt...->sbp...", hit, x)


def _select_float32_fwd(x, positions):
  return _select_float32(x, positions), (positions, x.shape[1])


def _select_float32_bwd(residuals, cotangent):
  positions, length = residuals
  hit = positions[..., None] == jnp.arange(length)
  return _one_hot_matmul("bpt,sbp...->sbt...", hit, cotangent), None


_select_float32.defvjp(_select_float32_fwd, _select_float32_bwd)


def _stacked_blocks(config: ml_collections.ConfigDict, rngs: nnx.Rngs,
                    metaplasticity: bool | None) -> Block:
  """num_layers Blocks as one Block whose variables have a leading layer axis.

  Logical sharding names gain LAYERS_AXIS in front (replicated by the default
  rules).
  """
  @nnx.split_rngs(splits=config.num_layers)
  @nnx.vmap(in_axes=0, out_axes=0,
            transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS})
  def build(rngs):
    return Block(config, rngs, metaplasticity=metaplasticity)

  return build(rngs)


def build_model(config: ml_collections.ConfigDict,
                rngs: nnx.Rngs) -> LanguageModel:
  """The LanguageModel a model config describes."""
  return LanguageModel(config, rngs=rngs)

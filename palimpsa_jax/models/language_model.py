"""Language model: embedding, mixer blocks, final norm, tied head."""

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from palimpsa_jax.layers import (Attention, GatedDeltaNet, KVCache,
                                 MetaMamba2, PalimpsaD, RMSNorm, SwiGLU)
from palimpsa_jax.layers import params as params_lib

Mixer = PalimpsaD | MetaMamba2 | GatedDeltaNet | Attention
METAPLASTIC_MIXERS = ("palimpsa_d", "meta_mamba2")


def metaplastic_layers(config: ml_collections.ConfigDict) -> tuple[int, ...]:
  """Sorted indices of the layers whose mixer is metaplastic under `config`.

  Every layer when config.metaplasticity, else config.metaplastic_layers.

  Raises:
    ValueError: config.metaplastic_layers holds repeats or indices outside
      [0, num_layers), or is set for a mixer without metaplasticity.
  """
  listed = [int(i) for i in (config.get("metaplastic_layers") or ())]
  if listed and config.mixer not in METAPLASTIC_MIXERS:
    raise ValueError(
        f"config.metaplastic_layers={listed} needs a mixer in "
        f"{METAPLASTIC_MIXERS}, got config.mixer={config.mixer!r}")
  if len(set(listed)) != len(listed):
    raise ValueError(f"config.metaplastic_layers={listed} contains repeats")
  outside = [i for i in listed if not 0 <= i < config.num_layers]
  if outside:
    raise ValueError(
        f"config.metaplastic_layers={listed}: indices {outside} are outside "
        f"[0, num_layers={config.num_layers})")
  if config.get("metaplasticity", False):
    return tuple(range(config.num_layers))
  return tuple(sorted(listed))


def make_mixer(config: ml_collections.ConfigDict, rngs: nnx.Rngs,
               metaplasticity: bool | None = None) -> Mixer:
  """The mixer named by config.mixer, built from the config's fields.

  metaplasticity (palimpsa_d / meta_mamba2 only) overrides
  config.metaplasticity, e.g. for one layer of a converted model.
  """
  if metaplasticity is None:
    metaplasticity = config.metaplasticity
  dtype = jnp.dtype(config.dtype)
  common = dict(rngs=rngs, init_std=config.init_std, dtype=dtype)
  if config.mixer == "attention":
    return Attention(config.d_model, num_heads=config.num_heads,
                     head_dim=config.head_dim, rope=config.rope,
                     rope_theta=config.rope_theta,
                     implementation=config.get("attention_implementation"),
                     **common)
  recurrent = dict(
      conv_kernel=config.conv_kernel, A_init=config.A_init,
      A_init_range=tuple(config.A_init_range), dt_min=config.dt_min,
      dt_max=config.dt_max, dt_init_floor=config.dt_init_floor,
      norm_eps=config.norm_eps, implementation=config.implementation,
      chunk_size=config.chunk_size, **common)
  if config.mixer == "palimpsa_d":
    return PalimpsaD(config.d_model, num_heads=config.num_heads,
                     head_k_dim=config.head_k_dim,
                     head_v_dim=config.head_v_dim, beta_rank=config.beta_rank,
                     metaplasticity=metaplasticity, **recurrent)
  if config.mixer == "meta_mamba2":
    return MetaMamba2(config.d_model, expand=config.expand,
                      head_dim=config.head_dim, state_dim=config.state_dim,
                      num_groups=config.num_groups, beta_rank=config.beta_rank,
                      metaplasticity=metaplasticity, **recurrent)
  if config.mixer == "gated_deltanet":
    return GatedDeltaNet(config.d_model, num_heads=config.num_heads,
                         head_k_dim=config.head_k_dim,
                         head_v_dim=config.head_v_dim, **recurrent)
  raise ValueError(
      "config.mixer must be 'palimpsa_d', 'meta_mamba2', 'gated_deltanet' or "
      f"'attention', got {config.mixer!r}")


class Block(nnx.Module):
  """h + mixer(norm(h)), then h + SwiGLU(norm(h)) when the block has an MLP."""

  def __init__(self, config: ml_collections.ConfigDict, rngs: nnx.Rngs,
               metaplasticity: bool | None = None):
    dtype = jnp.dtype(config.dtype)
    self.mixer_norm = RMSNorm(config.d_model, eps=config.norm_eps, dtype=dtype)
    self.mixer = make_mixer(config, rngs, metaplasticity)
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
    return self._mlp(h + out.astype(h.dtype)), diagnostics

  def prefill(self, h: jax.Array, cache: Any, single_step: bool = False):
    """Runs h [B, T, d] from the mixer's cache -> (h, new cache)."""
    mixer_call = self.mixer.step if single_step else self.mixer.prefill
    out, cache = mixer_call(self.mixer_norm(h), cache)
    return self._mlp(h + out.astype(h.dtype)), cache

  def _mlp(self, h):
    if self.mlp is None:
      return h
    return h + self.mlp(self.mlp_norm(h)).astype(h.dtype)


class LanguageModel(nnx.Module):
  """Decoder-only LM with a head tied to the token embedding.

  Parameters are float32; compute runs in config.dtype; the residual stream
  is float32 when config.residual_in_fp32; logits are float32. The mixers of
  metaplastic_layers(config) are metaplastic, the others are not.
  """

  def __init__(self, config: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    metaplastic = metaplastic_layers(config)
    self.embed = params_lib.make_param(
        params_lib.normal_init(config.init_std)(
            rngs.params(), (config.vocab_size, config.d_model)),
        ("vocab", "embed"))
    self.blocks = nnx.List([
        Block(config, rngs, metaplasticity=(
            i in metaplastic if config.mixer in METAPLASTIC_MIXERS else None))
        for i in range(config.num_layers)])
    self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps,
                              dtype=jnp.dtype(config.dtype))
    self.vocab_size = config.vocab_size
    self.dtype = jnp.dtype(config.dtype)
    self.residual_dtype = (jnp.dtype(jnp.float32) if config.residual_in_fp32
                           else self.dtype)
    self.remat = config.remat

  def _check_tokens(self, tokens: jax.Array) -> None:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(
          f"tokens must be [B, T] integers, got {tokens.shape} {tokens.dtype}")

  def _embed(self, tokens):
    self._check_tokens(tokens)
    return jnp.take(self.embed[...], tokens, axis=0).astype(
        self.residual_dtype)

  def _logits(self, h):
    h = self.final_norm(h)
    return jnp.einsum("btd,vd->btv", h, self.embed[...].astype(self.dtype),
                      preferred_element_type=jnp.float32)

  def __call__(self, tokens: jax.Array, *,
               segment_ids: jax.Array | None = None,
               return_diagnostics: bool = False):
    """tokens [B, T] int -> logits [B, T, vocab] f32.

    With return_diagnostics, also a list with each block's mixer diagnostics.
    """
    if segment_ids is not None and segment_ids.shape != tokens.shape:
      raise ValueError(
          f"segment_ids must be [B, T] = {tokens.shape}, got "
          f"{segment_ids.shape}")
    h = self._embed(tokens)
    diagnostics = []
    for block in self.blocks:
      if self.remat:
        h, diag = nnx.remat(
            lambda blk, h, seg: blk(h, seg, return_diagnostics))(
                block, h, segment_ids)
      else:
        h, diag = block(h, segment_ids, return_diagnostics)
      diagnostics.append(diag)
    logits = self._logits(h)
    return (logits, diagnostics) if return_diagnostics else logits

  def init_cache(self, batch_size: int, max_length: int,
                 dtype=None) -> tuple[Any, ...]:
    """One fixed-shape cache per block (dtype: KV cache dtype)."""
    dtype = dtype or self.dtype
    return tuple(block.mixer.init_cache(batch_size, max_length, dtype)
                 for block in self.blocks)

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
    if len(cache) != len(self.blocks):
      raise ValueError(
          f"cache has {len(cache)} entries, the model {len(self.blocks)} "
          "blocks")
    h = self._embed(tokens)
    new_cache = []
    for block, block_cache in zip(self.blocks, cache):
      h, block_cache = block.prefill(h, block_cache, single_step)
      new_cache.append(block_cache)
    return self._logits(h), tuple(new_cache)


def build_model(config: ml_collections.ConfigDict,
                rngs: nnx.Rngs) -> LanguageModel:
  """The LanguageModel a model config describes."""
  return LanguageModel(config, rngs=rngs)

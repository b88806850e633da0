"""A tiny causal NNX language model and MQAR config for trainer tests.

It has the project model's interface (`model(tokens, segment_ids=None,
positions=None)` -> [B, T or P, vocab] f32 logits, and `token_losses` as the
training steps call it) and sharding metadata, but trains in milliseconds.
"""

from flax import nnx
import jax.numpy as jnp
import ml_collections

from palimpsa_jax import models
from palimpsa_jax.ops import token_loss
from palimpsa_jax.training import state as state_lib

VOCAB = 32


class TinyLM(nnx.Module):
  """Embedding, a causal running-mean mixer with a gate, tied output."""

  def __init__(self, vocab_size: int, width: int, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Embed(
        vocab_size, width, embedding_init=nnx.with_partitioning(
            init, ("vocab", "embed")), rngs=rngs)
    self.mix = nnx.Linear(
        2 * width, width, use_bias=True,
        kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)

  def __call__(self, tokens, segment_ids=None, positions=None):
    return self.embed.attend(self._hidden(tokens, positions)).astype(jnp.float32)

  def token_losses(self, tokens, targets, weights=None, segment_ids=None, positions=None):
    """The tied head's TokenLoss [B, T or P], as LanguageModel.token_losses."""
    return token_loss(self._hidden(tokens, positions), self.embed.embedding[...], targets,
                      weights)

  def _hidden(self, tokens, positions):
    x = self.embed(tokens)
    steps = jnp.arange(1, tokens.shape[1] + 1, dtype=x.dtype)[None, :, None]
    context = jnp.cumsum(x, axis=1) / steps
    h = x + jnp.tanh(self.mix(jnp.concatenate([x, context], axis=-1)))
    if positions is not None:
      h = models.take_positions(h, positions)
    return h


def build(config, rngs):
  return TinyLM(config.vocab_size, config.width, rngs)


def decay_mask(params):
  return {"embed": {"embedding": True},
          "mix": {"kernel": True, "bias": False}} if "mix" in params else params


def use_tiny_model(patcher) -> None:
  """Points the trainer at TinyLM (patcher: pytest's monkeypatch or similar)."""
  patcher.setattr(state_lib, "run_model_fn",
                  lambda config: lambda rngs: build(config.model, rngs))


def tiny_mqar_config(**overrides) -> ml_collections.ConfigDict:
  """A few-second MQAR run of TinyLM."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).parents[2] / "configs" / "mqar.py"
  spec = importlib.util.spec_from_file_location("mqar_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.model_config = lambda args: ml_collections.ConfigDict(
      {"vocab_size": args.vocab_size, "width": args.d_model})
  config = module.get_config(
      f"seq_len=16,num_kv_pairs=2,vocab_size={VOCAB},d_model=16,num_train_examples=256,"
      "num_test_examples=64,batch_size=16,num_epochs=2,learning_rate=1e-2,evals_per_epoch=2")
  config.eval_batch_size = 32
  config.async_checkpointing = False
  config.log_diagnostics = False
  for key, value in overrides.items():
    target = config
    *parents, leaf = key.split(".")
    for parent in parents:
      target = target[parent]
    target[leaf] = value
  return config


def resumable_mqar_config(total_steps: int, **overrides) -> ml_collections.ConfigDict:
  """tiny_mqar_config logging every 2 steps, evaluating and checkpointing every 4.

  The learning-rate schedule decays over 16 steps whatever total_steps is, so a run
  planned for 8 steps and then resumed to 16 follows the same schedule as 16 steps at once.
  """
  return tiny_mqar_config(**{
      "total_steps": total_steps, "log_every_steps": 2, "eval_every_steps": 4,
      "checkpoint_every_steps": 4, "optimizer.decay_steps": 16, **overrides})

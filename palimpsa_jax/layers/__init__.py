"""Flax NNX layers: mixers, short conv, norms, SwiGLU, RoPE."""

from palimpsa_jax.layers.attention import Attention, KVCache
from palimpsa_jax.layers.conv import ShortConv
from palimpsa_jax.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetCache
from palimpsa_jax.layers.linear import Dense
from palimpsa_jax.layers.mesanet import MesaNet, MesaNetCache
from palimpsa_jax.layers.meta_mamba2 import MetaMamba2, MetaMamba2Cache
from palimpsa_jax.layers.mlp import SwiGLU, swiglu_hidden_dim
from palimpsa_jax.layers.norms import GatedRMSNorm, RMSNorm, l2_normalize
from palimpsa_jax.layers.palimpsa_d import PalimpsaD, PalimpsaDCache
from palimpsa_jax.layers.readout import READOUT
from palimpsa_jax.layers.rope import apply_rope

__all__ = [
    "Attention",
    "Dense",
    "GatedDeltaNet",
    "GatedDeltaNetCache",
    "GatedRMSNorm",
    "KVCache",
    "MesaNet",
    "MesaNetCache",
    "MetaMamba2",
    "MetaMamba2Cache",
    "PalimpsaD",
    "PalimpsaDCache",
    "READOUT",
    "RMSNorm",
    "ShortConv",
    "SwiGLU",
    "apply_rope",
    "l2_normalize",
    "swiglu_hidden_dim",
]

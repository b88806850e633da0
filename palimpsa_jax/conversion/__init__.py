"""Mamba2 / NotPalimpsa -> Palimpsa conversion ("surgery", docs/models.md, conversion).

  python -m palimpsa_jax.conversion --source <checkpoint> --dest <dir> \
      --layers <auto:N | i,j,k | none> --init <paper | zero>
"""

from palimpsa_jax.conversion.checkpoint import load_converted, read_conversion, write_conversion
from palimpsa_jax.conversion.command import run_conversion
from palimpsa_jax.conversion.hf_mamba2 import load_hf_mamba2
from palimpsa_jax.conversion.sources import Source, load_source
from palimpsa_jax.conversion.surgery import convert
from palimpsa_jax.conversion.windows import choose_layers, head_windows, layer_windows

__all__ = [
    "Source",
    "choose_layers",
    "convert",
    "head_windows",
    "layer_windows",
    "load_converted",
    "load_hf_mamba2",
    "load_source",
    "read_conversion",
    "run_conversion",
    "write_conversion",
]

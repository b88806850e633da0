"""Fast Palimpsa's kernels for NVIDIA Hopper GPUs: the exact chunk-boundary states on Mosaic
GPU (the chunks' reads are matmuls, in palimpsa_jax.ops.fast_palimpsa.gpu)."""

from pallas_kernels.fast_palimpsa_gpu.support import check_supported, hopper_available
from pallas_kernels.fast_palimpsa_gpu.states import chunk_states, dot_precision

__all__ = ["check_supported", "chunk_states", "dot_precision", "hopper_available"]

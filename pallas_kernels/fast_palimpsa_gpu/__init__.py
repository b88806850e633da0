"""Fast Palimpsa's kernels for NVIDIA Hopper GPUs: the exact chunk-boundary states on Mosaic
GPU (states.py) and the chunks' reads as one fused Mosaic GPU kernel per direction (reads.py)."""

from pallas_kernels.fast_palimpsa_gpu.reads import (chunk_start_terms, fused_reads, reads_call,
                                                    step_gates, step_rows)
from pallas_kernels.fast_palimpsa_gpu.states import chunk_states, dot_precision
from pallas_kernels.fast_palimpsa_gpu.support import check_supported, hopper_available

__all__ = ["check_supported", "chunk_start_terms", "chunk_states", "dot_precision",
           "fused_reads", "hopper_available", "reads_call", "step_gates", "step_rows"]

"""Fast Palimpsa on NVIDIA Hopper GPUs: Mosaic GPU chunk states, chunk reads as matmuls."""

from pallas_kernels.fast_palimpsa_gpu.op import check_supported, fast_palimpsa_gpu

__all__ = ["check_supported", "fast_palimpsa_gpu"]

"""Exact Palimpsa on NVIDIA GPUs with Pallas (Triton lowering)."""

from pallas_kernels.palimpsa_gpu.op import palimpsa_gpu

__all__ = ["palimpsa_gpu"]

"""Exact Palimpsa on NVIDIA GPUs with Pallas (Triton lowering; a Mosaic GPU backward walk on
Hopper and newer)."""

from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig, make_config
from pallas_kernels.palimpsa_gpu.op import palimpsa_gpu

__all__ = ["GpuKernelConfig", "make_config", "palimpsa_gpu"]

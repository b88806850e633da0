"""Exact Palimpsa on NVIDIA GPUs with Pallas: each stage's kernel on Mosaic GPU (Hopper and
newer) or Triton."""

from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig
from pallas_kernels.palimpsa_gpu.op import check_supported, palimpsa_gpu
from pallas_kernels.palimpsa_gpu.stages import make_config

__all__ = ["GpuKernelConfig", "check_supported", "make_config", "palimpsa_gpu"]

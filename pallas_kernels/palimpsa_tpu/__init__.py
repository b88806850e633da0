"""Exact Palimpsa as Pallas Mosaic TPU kernels (forward and backward); see docs/tpu.md."""

from pallas_kernels.palimpsa_tpu.op import palimpsa_tpu

__all__ = ["palimpsa_tpu"]


"""Exact Palimpsa as Pallas Mosaic TPU kernels (forward and backward); see docs/tpu.md."""

from pallas_kernels.palimpsa_tpu.op import check_supported, palimpsa_tpu

__all__ = ["check_supported", "palimpsa_tpu"]


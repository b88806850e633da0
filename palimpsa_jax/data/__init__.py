"""Data: the MQAR generator and grain pipelines (text lives in data/text.py)."""

from palimpsa_jax.data.mqar import IGNORE_INDEX, multiquery_ar
from palimpsa_jax.data.pipeline import array_dataset, pad_rows

__all__ = ["IGNORE_INDEX", "array_dataset", "multiquery_ar", "pad_rows"]

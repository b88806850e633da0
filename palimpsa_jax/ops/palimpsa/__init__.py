"""The Palimpsa op: public function, result types and the float64 reference."""

from palimpsa_jax.ops.palimpsa.api import palimpsa
from palimpsa_jax.ops.palimpsa.reference import reference_palimpsa
from palimpsa_jax.ops.palimpsa_contract import PalimpsaResult, PalimpsaState

__all__ = ["palimpsa", "reference_palimpsa", "PalimpsaResult", "PalimpsaState"]

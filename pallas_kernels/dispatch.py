"""The one rule by which a computation with several implementations picks one.

A table maps names to entries; every entry answers `supports(call) -> str | None`: None where
it runs the call, else why it cannot, as a short clause ("it needs a Hopper GPU (sm_90)").
"auto" runs the first name of a preference order whose entry supports the call; a name given
explicitly runs where its entry supports the call and is refused with that reason elsewhere,
never replaced by another.

The ops choose their implementation by it (palimpsa_jax.ops.dispatch: a preference order per
platform), and so does each stage of the GPU kernel (pallas_kernels.palimpsa_gpu.stages: its
table's order). It lives here, below both, because pallas_kernels never imports palimpsa_jax.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

AUTO = "auto"


class Entry(Protocol):
  """What a table holds: anything that says whether it runs a call."""

  def supports(self, call: Any) -> str | None:
    ...


def refused(name: str, reason: str) -> ValueError:
  """The default refusal: ValueError naming the implementation and why."""
  return ValueError(f"implementation={name!r} cannot run this call: {reason}")


def names(table: Mapping[str, Entry]) -> tuple[str, ...]:
  """The names a caller may give: "auto" and the table's."""
  return (AUTO, *table)


def check_name(name: str, table: Mapping[str, Entry], argument: str = "implementation") -> None:
  """Raises ValueError unless `name` is "auto" or a name of the table."""
  if name not in names(table):
    raise ValueError(f"{argument} must be one of {names(table)}, got {name!r}.")


def choose(table: Mapping[str, Entry], name: str, preference: Sequence[str], call: Any, *,
           refuse: Callable[[str, str], Exception] = refused) -> str:
  """The name of the entry that runs `call`.

  Args:
    table: name -> entry.
    name: "auto" or a name of the table.
    preference: names of the table, most preferred first: what "auto" tries, in order.
    call: what every `supports` is asked about (each table says what its calls are).
    refuse: (name, reason) -> the exception raised for a named entry that cannot run the call
      (or for "auto" where none of the preference can, with every reason).

  Raises:
    ValueError: an unknown name.
    What `refuse` returns: the named entry, or every entry of the preference under "auto",
      cannot run the call.
  """
  check_name(name, table)
  if name != AUTO:
    reason = table[name].supports(call)
    if reason is not None:
      raise refuse(name, reason)
    return name
  reasons = []
  for candidate in preference:
    reason = table[candidate].supports(call)
    if reason is None:
      return candidate
    reasons.append(f"{candidate}: {reason}")
  raise refuse(AUTO, "; ".join(reasons) or "no implementation is preferred here")

"""Kinds of value a setting accepts, each checked by one function wherever the value comes from.

A Field says what one setting accepts: its types, a check, and what an allowed value is, for the
refusal ("a positive int"). The same Field checks
  - a run-config field (base.py's schema, when a run starts: `--config.<field>=` overrides),
  - the config-file argument that sets that field (config_args.py, while the config file parses
    `configs/x.py:key=value`), and
  - a command-line flag of an entry point (`check_flag`: absl refuses the flag while parsing).

  positive()                       1, 2, ...          (kind=float: any number > 0)
  at_least(2)                      2, 3, ...          (seq_len, eval.py's --max_length)
  in_interval(0, 1, high_closed=False)  [0, 1)        (Adam's b1, b2)
  or_none(positive(), "no limit")  a positive int, or None meaning "no limit"
  one_of("a", ("a", "b"))          "a" or "b"
"""

from collections.abc import Callable
import dataclasses
from typing import Any

from absl import flags

REQUIRED = object()  # A default that means "the config file sets this field".


def _is_type(value: Any, types: tuple[type, ...]) -> bool:
  """isinstance, except that a bool is never an int or a float and an int is also a float."""
  if isinstance(value, bool):
    return bool in types
  if float in types and isinstance(value, int):
    return True
  return isinstance(value, types)


@dataclasses.dataclass(frozen=True)
class Field:
  """What one setting accepts.

  Attributes:
    default: its default value, or REQUIRED.
    types: the accepted value types (bool is never an int or a float here).
    check: value -> whether it is allowed (after the type check).
    expected: what an allowed value is, for the refusal ("a positive int").
  """
  default: Any
  types: tuple[type, ...]
  check: Callable[[Any], bool]
  expected: str

  def accepts(self, value: Any) -> bool:
    return _is_type(value, self.types) and self.check(value)


def _any(_: Any) -> bool:
  return True


def _number(kind: type) -> str:
  return "an int" if kind is int else "a number"


def anything(default: Any, kind: type) -> Field:
  """Any value of type `kind` (a seed)."""
  return Field(default, (kind,), _any, _number(kind) if kind in (int, float) else kind.__name__)


def positive(default: Any = REQUIRED, kind: type = int) -> Field:
  """A positive `kind`: an int >= 1, or a number > 0."""
  return Field(default, (kind,), lambda v: v > 0,
               f"a positive {'int' if kind is int else 'number'}")


def at_least(minimum: int | float, default: Any = REQUIRED, kind: type = int) -> Field:
  """A `kind` >= minimum."""
  return Field(default, (kind,), lambda v: v >= minimum, f"{_number(kind)} >= {minimum}")


def in_interval(low: float, high: float, default: Any = REQUIRED, *, low_closed: bool = True,
                high_closed: bool = True) -> Field:
  """A number in [low, high]; low_closed / high_closed False leave that end out."""
  def check(v):
    return (low <= v if low_closed else low < v) and (v <= high if high_closed else v < high)
  interval = f"{'[' if low_closed else '('}{low:g}, {high:g}{']' if high_closed else ')'}"
  return Field(default, (float,), check, f"a number in {interval}")


def or_none(field: Field, meaning: str, default: Any = None) -> Field:
  """What `field` accepts, or None, which means `meaning` ("no clipping")."""
  return Field(default, (*field.types, type(None)), lambda v: v is None or field.check(v),
               f"{field.expected}, or None ({meaning})")


def one_of(default: Any, choices: tuple[Any, ...]) -> Field:
  """One of `choices` (strings, or None too)."""
  return Field(default, tuple(dict.fromkeys(type(c) for c in choices)), lambda v: v in choices,
               f"one of {choices}")


def flag(default: bool) -> Field:
  return Field(default, (bool,), _any, "True or False")


def check_flag(holder: flags.FlagHolder, field: Field) -> None:
  """Makes absl refuse the flag unless `field` accepts its value (None: not given), as
  "flag --name=value: expected <field.expected>" (user_errors reports it in one line)."""
  flags.register_validator(holder, lambda value: value is None or field.accepts(value),
                           message=f"expected {field.expected}")

"""Plain-text tables of evaluation results, aligned by the width a terminal gives each character
(a CJK character takes two columns, a combining accent none)."""

from collections.abc import Sequence
import unicodedata


def display_width(text: str) -> int:
  """Terminal columns of `text`: 2 for wide and fullwidth characters, 0 for combining marks
  and zero-width formatting characters, 1 for the others."""
  width = 0
  for char in text:
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cf"):
      continue
    width += 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
  return width


def shorten(text: str, most: int) -> str:
  """`text`, or "..." and its end, at most `most` columns wide (a path's end says most)."""
  if display_width(text) <= most:
    return text
  kept = ""
  for char in reversed(text):
    if display_width(char + kept) > most - 3:
      break
    kept = char + kept
  return "..." + kept


def _pad(text: str, width: int, right: bool) -> str:
  fill = " " * (width - display_width(text))
  return fill + text if right else text + fill


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                 right: Sequence[bool]) -> str:
  """A header, a rule and the rows, each column as wide as its widest cell.

  Args:
    header: the column names.
    rows: the cells, already formatted as text.
    right: per column, whether it is aligned right (numbers) or left (names).
  """
  widths = [max(display_width(cell) for cell in column) for column in zip(header, *rows)]
  lines = [" ".join(_pad(cell, width, r) for cell, width, r in zip(line, widths, right)).rstrip()
           for line in (header, *rows)]
  lines.insert(1, "-" * (sum(widths) + len(widths) - 1))
  return "\n".join(lines)

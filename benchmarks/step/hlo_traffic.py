"""The bytes an optimized XLA program's fusions and copies move, by the source line behind each.

    python -m benchmarks.step.hlo_traffic DUMP.txt [--top 40] [--by line|fusion]

Reads the text of a compiled program (`compiled.as_text()`, or an XLA dump's
`*after_optimizations.txt`) and counts, for every non-GEMM fusion and copy, the bytes of its
operands plus its output, times how often it runs (the trip count of each enclosing while
loop). An operand the fusion only reads through slices counts the slices; an output written
in place by a dynamic-update-slice counts the update. GEMM fusions, library calls and custom
calls (the Pallas kernels) are left out: this is the memory traffic of XLA's own kernels, the
share of a step that moves with the layers' elementwise work, layouts and the scan's stacking.
At a GPU's memory bandwidth it is a floor on those kernels' time, not a timing.
"""

import argparse
import collections
import dataclasses
import pathlib
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
_OPERAND = re.compile(r"%([\w.\-]+(?:#\d+)?)")
# Where a step's scanned layers stack and read back their residuals: JAX's scan.
SCAN_SOURCE = "scan (stacking)"


@dataclasses.dataclass
class Traffic:
  """One row: a source line (or fusion), its launches per program run and bytes moved."""

  kind: str  # "fusion" or "copy"
  where: str
  launches: int = 0
  bytes: float = 0.0


def shape_bytes(shape: str) -> int:
  """Bytes of every array in an HLO shape string (a tuple counts each element)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    total += count * _DTYPE_BYTES[dtype]
  return total


def traffic(hlo: str, by: str = "line") -> list[Traffic]:
  """Rows of `hlo` (a compiled program's text), largest first; by "line" (the innermost
  project source line of each instruction, 'file:line (function)') or "fusion" (each
  instruction by name)."""
  computations = _computations(hlo)
  shapes = {m.group(1): m.group(2) for lines in computations.values() for line in lines
            if (m := _INSTRUCTION.match(line))}
  locations = _source_locations(hlo)
  rows: dict[tuple[str, str], Traffic] = {}
  for name, runs in _runs_per_computation(computations).items():
    for line in computations[name]:
      m = _INSTRUCTION.match(line)
      if not m or not _counted(m.group(1), m.group(3), line):
        continue
      kind = "copy" if m.group(3) in ("copy", "copy-start", "transpose") else "fusion"
      moved = _moved_bytes(m, line, computations, shapes)
      frame = re.search(r"stack_frame_id=(\d+)", line)
      where = locations(int(frame.group(1))) if frame else "?"
      if by == "fusion":
        where = f"{m.group(1)} {m.group(2)[:60]} {where}"
      row = rows.setdefault((kind, where), Traffic(kind, where))
      row.launches += runs
      row.bytes += moved * runs
  return sorted(rows.values(), key=lambda r: -r.bytes)


def _counted(name: str, opcode: str, line: str) -> bool:
  if opcode in ("copy", "copy-start", "transpose"):
    return True
  if opcode != "fusion":
    return False
  library = ('"kind":"__triton_gemm' in line or "gemm_fusion" in name or "cublas" in line
             or '"kind":"__custom_fusion"' in line or name.startswith("dynamic-slice-fusion"))
  return not library


def _computations(hlo: str) -> dict[str, list[str]]:
  computations, current = {}, None
  for line in hlo.splitlines():
    if m := _COMPUTATION.match(line):
      current = computations.setdefault(("ENTRY " if m.group(1) else "") + m.group(2), [])
    elif line.startswith("}"):
      current = None
    elif current is not None and line.strip():
      current.append(line)
  return computations


def _runs_per_computation(computations: dict[str, list[str]]) -> dict[str, int]:
  """How often each computation that holds kernels runs per program run: the entry once, a
  while body its known trip count times its caller's, async and called computations as their
  caller (fused computations are not listed)."""
  callees = collections.defaultdict(list)
  names = {name.removeprefix("ENTRY "): name for name in computations}
  for name, lines in computations.items():
    for line in lines:
      m = _INSTRUCTION.match(line)
      if not m or m.group(3) == "fusion":
        continue
      trips = 1
      if m.group(3) == "while":
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        trips = int(known.group(1)) if known else 1
        targets = re.findall(r"body=%([\w.\-]+)", line)
      else:
        targets = re.findall(r"(?:to_apply|calls|branch_computations=\{)=?%([\w.\-]+)", line)
      callees[name] += [(names[t], trips) for t in targets if t in names]
  runs = collections.Counter()
  entry = next(name for name in computations if name.startswith("ENTRY "))
  todo = [(entry, 1)]
  while todo:
    name, count = todo.pop()
    runs[name] += count
    todo += [(callee, count * trips) for callee, trips in callees[name]]
  return runs


def _moved_bytes(m: re.Match, line: str, computations, shapes) -> int:
  """Operands read plus output written by one launch of the instruction in match `m`."""
  operands = _OPERAND.findall(_split_operands(m.group(4)))
  written = shape_bytes(m.group(2))
  read_as = {}  # operand index -> bytes actually read (slices) or 0 (updated in place)
  called = re.search(r"calls=%([\w.\-]+)", line)
  if called and called.group(1) in computations:
    body = computations[called.group(1)]
    parameters, users = {}, collections.defaultdict(list)
    for inner in body:
      im = _INSTRUCTION.match(inner)
      if not im:
        continue
      if im.group(3) == "parameter":
        parameters[im.group(1)] = int(re.search(r"parameter\((\d+)\)", inner).group(1))
      inner_operands = _OPERAND.findall(_split_operands(im.group(4)))
      for position, operand in enumerate(inner_operands):
        users[operand].append((im.group(3), position, im.group(2), inner_operands, im.group(1)))
    for parameter, index in parameters.items():
      uses = _through_bitcasts(parameter, users)
      if uses and all(op in ("dynamic-slice", "slice") and pos == 0 for op, pos, *_ in uses):
        read_as[index] = sum(shape_bytes(shape) for _, _, shape, *_ in uses)
      elif uses and all(op == "dynamic-update-slice" and pos == 0 for op, pos, *_ in uses):
        read_as[index] = 0
        if index < len(operands):  # Written in place: only the updates.
          written -= shape_bytes(_operand_shape(shapes, operands[index]))
          written += sum(shape_bytes(_operand_shape(shapes, inner[1]))
                         for _, _, _, inner, _ in uses)
  read = sum(read_as.get(i, shape_bytes(_operand_shape(shapes, o)))
             for i, o in enumerate(operands))
  return read + max(written, 0)


def _through_bitcasts(value, users):
  found = []
  for use in users[value]:
    found += _through_bitcasts(use[4], users) if use[0] == "bitcast" else [use]
  return found


def _split_operands(rest: str) -> str:
  depth = 0
  for i, ch in enumerate(rest):
    if ch == "(":
      depth += 1
    elif ch == ")":
      if depth == 0:
        return rest[:i]
      depth -= 1
  return rest


def _operand_shape(shapes: dict[str, str], operand: str) -> str:
  """The shape of an operand; 'x#k' is element k of the tuple x."""
  if "#" not in operand:
    return shapes.get(operand, "")
  name, index = operand.split("#")
  return _tuple_elements(shapes.get(name, ""))[int(index)]


def _tuple_elements(shape: str) -> list[str]:
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  shape = re.sub(r"/\*index=\d+\*/", "", shape[1:-1])
  elements, depth, start = [], 0, 0
  for i, ch in enumerate(shape):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      elements.append(shape[start:i].strip())
      start = i + 1
  return elements + [shape[start:].strip()]


def _source_locations(hlo: str):
  """stack_frame_id -> 'file:line (function)' of the innermost frame in the project (the
  scan's own frame for the stacking JAX adds), from the module's stack-frame tables."""
  tables = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
  section = None
  for line in hlo.splitlines():
    if line in tables:
      section = line
      continue
    if line.startswith(("%", "ENTRY")):
      break
    if section and (m := re.match(r"^(\d+) (.*)$", line)):
      tables[section][int(m.group(1))] = m.group(2)
  files, functions = tables["FileNames"], tables["FunctionNames"]
  fields = lambda text: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text)}

  def location(frame_id: int) -> str:
    seen, chain = set(), []
    while frame_id in tables["StackFrames"] and frame_id not in seen:
      seen.add(frame_id)
      frame = fields(tables["StackFrames"][frame_id])
      loc = fields(tables["FileLocations"][frame["file_location_id"]])
      chain.append((files[loc["file_name_id"]].strip('"'),
                    functions[loc["function_name_id"]].strip('"'), loc["line"]))
      frame_id = frame["parent_frame_id"]
    for path, function, line in chain:
      for package in ("palimpsa_jax/", "pallas_kernels/"):
        if package in path:
          return f"{path[path.index(package):]}:{line} ({function})"
    if any("scan" in function for _, function, _ in chain):
      return SCAN_SOURCE
    return f"{chain[0][0].split('/')[-1]}:{chain[0][2]} ({chain[0][1]})" if chain else "?"

  return location


def markdown(rows: list[Traffic], top: int, bandwidth_gb_s: float | None = None) -> str:
  """The first `top` rows as a markdown table (with ms at `bandwidth_gb_s`, if given)."""
  head = "| kind | source | launches | GB |" + (" ms at bandwidth |" if bandwidth_gb_s else "")
  lines = [head, "|---|---|---|---|" + ("---|" if bandwidth_gb_s else "")]
  for row in rows[:top]:
    cells = [row.kind, row.where.replace("|", "/"), str(row.launches), f"{row.bytes / 1e9:.2f}"]
    if bandwidth_gb_s:
      cells.append(f"{row.bytes / bandwidth_gb_s / 1e6:.2f}")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def totals(rows: list[Traffic]) -> dict[str, float]:
  """GB and launches per kind, and the scan's stacking share."""
  out = collections.Counter()
  for row in rows:
    out[f"{row.kind}_gb"] += row.bytes / 1e9
    out[f"{row.kind}_launches"] += row.launches
    if row.where == SCAN_SOURCE:
      out["scan_stacking_gb"] += row.bytes / 1e9
  return {k: round(v, 3) for k, v in sorted(out.items())}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n")[0])
  parser.add_argument("hlo", help="an optimized program's text (compiled.as_text() or a dump)")
  parser.add_argument("--top", type=int, default=40)
  parser.add_argument("--by", choices=("line", "fusion"), default="line")
  args = parser.parse_args(argv)
  rows = traffic(pathlib.Path(args.hlo).read_text(), args.by)
  print(totals(rows))
  print(markdown(rows, args.top))


if __name__ == "__main__":
  main()

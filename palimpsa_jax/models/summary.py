"""Parameter counts and a per-module table."""

import math

import jax
from flax import nnx


def _count(state) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def parameter_table(model: nnx.Module) -> tuple[str, int]:
  """(table with one row per top-level module, total parameter count).

  Works on abstract models from nnx.eval_shape as well; list entries (the
  blocks) get a row each.
  """
  params = nnx.state(model, nnx.Param)
  rows = []
  for name, sub in sorted(params.items(), key=lambda kv: str(kv[0])):
    if hasattr(sub, "items") and all(isinstance(k, int) for k in sub.keys()):
      for index in sorted(sub.keys()):
        rows.append((f"{name}.{index}", _count(sub[index])))
    else:
      rows.append((str(name), _count(sub)))
  total = sum(n for _, n in rows)
  width = max([len(r[0]) for r in rows] + [len("total")])
  lines = [f"{'module':<{width}}  {'params':>15}"]
  lines += [f"{name:<{width}}  {n:>15,}" for name, n in rows]
  lines.append(f"{'total':<{width}}  {total:>15,}")
  return "\n".join(lines), total


def count_parameters(model: nnx.Module) -> int:
  """Total number of parameter entries."""
  return _count(nnx.state(model, nnx.Param))


def abstract_parameter_count(config, build) -> int:
  """Parameter count of build(config, rngs) via nnx.eval_shape (no allocation)."""
  model = nnx.eval_shape(lambda: build(config, nnx.Rngs(0)))
  return count_parameters(model)

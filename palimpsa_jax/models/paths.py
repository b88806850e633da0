"""Parameter names along pytree key paths (nnx.State or pure dicts)."""

from typing import Any


def path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
  """A jax.tree_util key path as names: dict keys, attributes and indices as str.

  NNX's trailing "value" entry (the Variable's payload) is dropped, so a
  parameter has the same names in an nnx.State and in its pure dict.
  """
  names = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        names.append(str(getattr(entry, attr)))
        break
    else:
      names.append(str(entry))
  return tuple(n for n in names if n != "value")

"""How every op runs the implementation a call asks for.

Each op's implementations.py holds IMPLEMENTATIONS (name -> Implementation: the function and
what it supports) and PREFERENCE (platform -> names, most preferred first); its api calls
`run`, which applies pallas_kernels.dispatch's rule: "auto" runs the first implementation of
the platform's order that supports the call (a kernel that cannot run it falls back to the
next, in the end an XLA form), a name given explicitly runs or is refused with ValueError
naming it and why. A Pallas kernel (an entry with shard_layouts) runs per device shard inside
ops.kernel_sharding, whose partitioner could not split it.
"""

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import functools
from typing import Any, NamedTuple

import jax

from palimpsa_jax.ops import kernel_sharding
from pallas_kernels import dispatch

# The key of PREFERENCE whose order applies on every platform not named in it.
ELSEWHERE = "elsewhere"


class Call(NamedTuple):
  """One call of an implementation: its positional arguments and its keyword options."""

  args: tuple[Any, ...]
  options: Mapping[str, Any]


# (options) -> (one layout per arg, one per output or None where the output is None), in
# ops.kernel_sharding's layout strings.
ShardLayouts = Callable[[Mapping[str, Any]], tuple[Sequence[str], Sequence[str | None]]]


def every_call(call: Call) -> None:
  """`supports` of an implementation that runs every validated call."""
  del call


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One entry of an op's table.

  fn: the implementation, called as fn(*call.args, **call.options) (the op's contract).
  supports: (Call) -> None where fn runs the call, else why not (pallas_kernels.dispatch).
  shard_layouts: for a Pallas kernel, its operands' and outputs' layouts: it then runs per
    device shard inside ops.kernel_sharding. None for an XLA form, which the partitioner
    splits itself.
  """

  fn: Callable[..., Any]
  supports: Callable[[Call], str | None] = every_call
  shard_layouts: ShardLayouts | None = None


def declined(check: Callable[..., Any], *args, **kwargs) -> str | None:
  """The reason check(*args, **kwargs) gives by raising NotImplementedError, or None where it
  returns: a kernel package's own check (which its kernel also runs) as a `supports`."""
  try:
    check(*args, **kwargs)
  except NotImplementedError as reason:
    return str(reason)
  return None


def unavailable(error: ImportError, shard_layouts: ShardLayouts | None = None
                ) -> Implementation:
  """The entry of a kernel whose module could not be imported (e.g. a jax without its Pallas
  backend): it supports no call, so "auto" passes it by and naming it is refused."""

  def fn(*args, **kwargs):
    del args, kwargs
    raise error

  return Implementation(fn, lambda call: f"its module cannot be imported: {error}",
                        shard_layouts)


def platform() -> str:
  """The default backend's platform: "cuda" (NVIDIA GPUs), "rocm" (AMD GPUs), "tpu", "cpu"."""
  name = jax.default_backend()
  if name != "gpu":
    return name
  return "rocm" if "rocm" in jax.devices()[0].client.platform_version.lower() else "cuda"


def preferred(preference: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
  """The names "auto" tries on this platform, in order."""
  return tuple(preference.get(platform(), preference[ELSEWHERE]))


def run(table: Mapping[str, Implementation], implementation: str,
        preference: Mapping[str, Sequence[str]], args: Sequence[Any],
        options: Mapping[str, Any]) -> Any:
  """Runs the implementation of `table` that the rule picks for this call; its outputs.

  Args:
    table: the op's IMPLEMENTATIONS.
    implementation: "auto" or a name of the table.
    preference: the op's PREFERENCE: platform -> names, with an ELSEWHERE entry.
    args, options: the call, in the table's contract.

  Raises:
    ValueError: an unknown name, or a named implementation that cannot run this call.
  """
  call = Call(tuple(args), options)
  entry = table[dispatch.choose(table, implementation, preferred(preference), call)]
  if entry.shard_layouts is None:
    return entry.fn(*args, **options)
  in_layouts, out_layouts = entry.shard_layouts(options)
  first = in_layouts[0]
  return kernel_sharding.shard_kernel(
      functools.partial(entry.fn, **options), args, in_layouts, out_layouts,
      batch_size=args[0].shape[first.index("b")], num_heads=args[0].shape[first.index("h")])

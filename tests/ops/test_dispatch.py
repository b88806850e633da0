"""The one dispatch rule (pallas_kernels.dispatch, ops.dispatch): "auto" runs the first
implementation of the platform's order that supports the call, a named one runs or is refused
with its reason, an unknown name is refused; kernels run through ops.kernel_sharding."""

import pytest

from palimpsa_jax.ops import dispatch, kernel_sharding
from pallas_kernels import dispatch as rule


def _table(kernel_reason):
  """A kernel that supports calls with x > 0 (else gives `kernel_reason`), and an XLA form."""
  return {
      "xla": dispatch.Implementation(lambda x, *, scale: ("xla", x * scale)),
      "kernel": dispatch.Implementation(
          lambda x, *, scale: ("kernel", x * scale),
          lambda call: None if call.args[0] > 0 else kernel_reason),
  }


PREFERENCE = {"cuda": ("kernel", "xla"), dispatch.ELSEWHERE: ("xla",)}


@pytest.mark.parametrize("platform, x, want", [
    ("cuda", 2, "kernel"),  # The platform's first choice supports the call.
    ("cuda", -2, "xla"),  # It does not: the next one runs.
    ("cpu", 2, "xla"),  # Another platform's order.
    ("tpu", 2, "xla"),  # A platform PREFERENCE does not name: ELSEWHERE's order.
])
def test_auto_runs_the_first_supporting_implementation_of_the_platform(
    monkeypatch, platform, x, want):
  monkeypatch.setattr(dispatch, "platform", lambda: platform)
  assert dispatch.run(_table("x <= 0"), "auto", PREFERENCE, (x,), dict(scale=3)) == (want, 3 * x)


def test_a_named_implementation_runs_wherever_it_supports_the_call(monkeypatch):
  monkeypatch.setattr(dispatch, "platform", lambda: "cpu")
  assert dispatch.run(_table("x <= 0"), "kernel", PREFERENCE, (2,), dict(scale=1)) == (
      "kernel", 2)


def test_a_named_implementation_that_cannot_run_is_refused_with_its_reason(monkeypatch):
  monkeypatch.setattr(dispatch, "platform", lambda: "cuda")
  with pytest.raises(ValueError,
                     match=r"^implementation='kernel' cannot run this call: x <= 0$"):
    dispatch.run(_table("x <= 0"), "kernel", PREFERENCE, (-2,), dict(scale=1))


def test_an_unknown_name_is_refused():
  with pytest.raises(ValueError, match=r"^implementation must be one of \('auto', 'xla', "
                     r"'kernel'\), got 'triton'\.$"):
    dispatch.run(_table("x <= 0"), "triton", PREFERENCE, (2,), dict(scale=1))


def test_a_missing_module_supports_no_call(monkeypatch):
  monkeypatch.setattr(dispatch, "platform", lambda: "cuda")
  table = {**_table("x <= 0"), "kernel": dispatch.unavailable(ImportError("no kernels"))}
  assert dispatch.run(table, "auto", PREFERENCE, (2,), dict(scale=1)) == ("xla", 2)
  with pytest.raises(ValueError, match="'kernel' cannot run.*cannot be imported: no kernels"):
    dispatch.run(table, "kernel", PREFERENCE, (2,), dict(scale=1))


def test_a_kernel_runs_through_kernel_sharding(monkeypatch):
  """An entry with shard_layouts runs through shard_kernel, told B and H from the first
  operand's layout; an XLA form runs directly."""
  seen = []

  def shard_kernel(kernel, args, in_layouts, out_layouts, batch_size, num_heads):
    seen.append((tuple(in_layouts), tuple(out_layouts), batch_size, num_heads))
    return kernel(*args)

  monkeypatch.setattr(kernel_sharding, "shard_kernel", shard_kernel)

  class Array:
    shape = (5, 7, 3, 2)  # [B, T, H, K]

  layouts = lambda options: (("b.h.",), ("b.h.",))
  table = {"kernel": dispatch.Implementation(lambda x: "ran", shard_layouts=layouts),
           "xla": dispatch.Implementation(lambda x: "ran directly")}
  assert dispatch.run(table, "kernel", {dispatch.ELSEWHERE: ("xla",)}, (Array(),), {}) == "ran"
  assert seen == [(("b.h.",), ("b.h.",), 5, 3)]
  assert dispatch.run(table, "xla", {dispatch.ELSEWHERE: ("xla",)}, (Array(),), {}) == (
      "ran directly")
  assert len(seen) == 1


class _Stage:
  def __init__(self, reason):
    self.reason = reason

  def supports(self, call):
    del call
    return self.reason


def test_the_rule_takes_any_table_and_refusal():
  """pallas_kernels.dispatch.choose, as the GPU kernel's stages use it: entries are anything
  with `supports`, the refusal is the caller's exception, and "auto" where nothing runs the
  call gives every reason."""
  table = {"fast": _Stage("too wide"), "slow": _Stage(None)}
  refuse = lambda name, reason: NotImplementedError(f"{name}: {reason}")
  assert rule.choose(table, "auto", ("fast", "slow"), None, refuse=refuse) == "slow"
  with pytest.raises(NotImplementedError, match="^fast: too wide$"):
    rule.choose(table, "fast", ("fast", "slow"), None, refuse=refuse)
  with pytest.raises(NotImplementedError, match="^auto: fast: too wide$"):
    rule.choose(table, "auto", ("fast",), None, refuse=refuse)

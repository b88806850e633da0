"""FLA's chunk kernels timed on the op's shapes in the same process (`bench.py --fla`).

The baselines a user compares the op with: FLA's chunk Gated DeltaNet (a delta-rule memory
with a scalar gate and a scalar write strength per head and step) and chunk SimpleGLA
(Mamba2's recurrence, no metaplasticity), both PyTorch + Triton. They compute other
recurrences, so their rows carry no error against the Palimpsa reference; they give the
"x FLA Gated DeltaNet" column. Needs torch with a CUDA GPU, triton and FLA
(fla-core and flash-linear-attention); without them the rows say why they are skipped.

Inputs as bench.py's: q, k L2-normalised, bfloat16 [B, T, H, K], v [B, T, H, V], the
log-decay g in log((0.8, 1)) float32 [B, T, H]; Gated DeltaNet's write strength beta in
(0, 1) [B, T, H]. Times are triton.testing.do_bench medians (CUDA events, warm-up 25 ms,
200 ms of repetitions).
"""

import importlib.metadata
import importlib.util

IMPLS = ("fla_gated_deltanet", "fla_simple_gla")
# FLA 0.6.0's kernels faulted with an illegal address at K = 16 on an H200 (MQAR's heads).
MIN_K = 32


def unavailable_reason() -> str | None:
  """Why FLA cannot be timed here, or None."""
  for package in ("torch", "triton", "fla"):
    if importlib.util.find_spec(package) is None:
      return f"skipped: {package} is not installed"
  import torch  # pylint: disable=import-outside-toplevel
  if not torch.cuda.is_available():
    return "skipped: torch sees no CUDA GPU"
  return None


def versions() -> dict[str, str]:
  """The installed versions of the packages FLA's timings depend on, for the record."""
  found = {}
  for package in ("torch", "triton", "fla-core", "flash-linear-attention"):
    try:
      found[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      pass
  return found


def _allow_hopper_backward():
  """FLA's gated backward refuses Triton < 3.7.1 on Hopper (a miscompile of its dq/dk
  kernel there); for timing alone the refusal is lifted. Returns a note, or None."""
  import triton  # pylint: disable=import-outside-toplevel
  from fla.ops.common import chunk_o  # pylint: disable=import-outside-toplevel
  if chunk_o.TRITON_ABOVE_3_7_1:
    return None
  chunk_o.TRITON_ABOVE_3_7_1 = True
  return (f"FLA's gated backward refuses triton {triton.__version__} on Hopper (results "
          "may be wrong there); its refusal was lifted for timing only")


def _inputs(shape, seed):
  import torch  # pylint: disable=import-outside-toplevel
  b, t, h, kd, vd = shape
  gen = torch.Generator(device="cuda").manual_seed(seed)
  rand = lambda *s: torch.randn(*s, device="cuda", generator=gen)
  unit = lambda x: x / x.norm(dim=-1, keepdim=True)
  q = unit(rand(b, t, h, kd)).bfloat16()
  k = unit(rand(b, t, h, kd)).bfloat16()
  v = rand(b, t, h, vd).bfloat16()
  g = torch.log(0.8 + 0.2 * torch.rand(b, t, h, device="cuda", generator=gen))
  beta = torch.sigmoid(rand(b, t, h)).bfloat16()
  do = rand(b, t, h, vd).bfloat16()
  return q, k, v, g, beta, do


def _callables(impl, q, k, v, g, beta):
  """The op of `impl` as f(*inputs) -> output [B, T, H, V], and its inputs."""
  from fla.ops import chunk_gated_delta_rule, chunk_simple_gla  # pylint: disable=import-outside-toplevel
  if impl == "fla_gated_deltanet":
    return (lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0)[0],
            [q, k, v, g, beta])
  return lambda q, k, v, g: chunk_simple_gla(q, k, v, g, scale=1.0)[0], [q, k, v, g]


def time_ms(impl: str, mode: str, shape, seed: int = 0) -> float:
  """Median ms of one call of FLA's `impl` ("fwd" or "fwd+bwd") at shape (B, T, H, K, V)."""
  import torch  # pylint: disable=import-outside-toplevel
  import triton.testing  # pylint: disable=import-outside-toplevel
  q, k, v, g, beta, do = _inputs(shape, seed)
  op, args = _callables(impl, q, k, v, g, beta)
  if mode == "fwd":
    def call():
      with torch.no_grad():
        op(*args)
  else:
    args = [x.detach().requires_grad_(True) for x in args]

    def call():
      op(*args).backward(do)
  return triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")


def rows(name, shape, log, impls=IMPLS) -> tuple[list[tuple], list[str]]:
  """bench.py rows (shape name, shape, impl, mode, ms, ms_synced, note, mem) of FLA's
  kernels `impls` (of IMPLS) at `shape`, and notes for the record."""
  reason = unavailable_reason()
  if reason is None and shape[3] < MIN_K:
    reason = f"skipped: FLA 0.6.0's kernels faulted at K = 16 on an H200 (K < {MIN_K})"
  if reason is not None:
    return [(name, shape, impl, mode, None, None, reason, None)
            for impl in impls for mode in ("fwd", "fwd+bwd")], []
  note = _allow_hopper_backward()
  out = []
  for impl in impls:
    for mode in ("fwd", "fwd+bwd"):
      ms = time_ms(impl, mode, shape)
      log(f"[{name}] {impl} {mode}: {ms:.3f} ms (another recurrence: no error)")
      out.append((name, shape, impl, mode, ms, None, "n/a (another recurrence)", None))
  return out, [note] if note else []


def main(argv: list[str] | None = None) -> None:
  """Runs FLA's kernels once per shape and mode, which autotunes them: FLA keeps Triton's
  choices in TRITON_CACHE_DIR, so a later process (bench.py --fla) compiles only those."""
  import argparse  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(prog=__spec__.name, description=main.__doc__.split("\n")[0])
  parser.add_argument("shapes", nargs="+", help="B,T,H,K,V")
  parser.add_argument("--impls", default=",".join(IMPLS),
                      help=f"comma-separated, of {', '.join(IMPLS)} (default: both)")
  args = parser.parse_args(argv)
  impls = [name for name in args.impls.split(",") if name]
  if not impls or set(impls) - set(IMPLS):
    parser.error(f"--impls: comma-separated names of {', '.join(IMPLS)}, got {args.impls!r}")
  reason = unavailable_reason()
  if reason is not None:
    parser.exit(1, f"benchmarks.op.fla: {reason}\n")
  note = _allow_hopper_backward()
  if note:
    print(note, flush=True)
  for text in args.shapes:
    shape = tuple(int(x) for x in text.split(","))
    if len(shape) != 5 or shape[3] < MIN_K:
      parser.exit(1, f"benchmarks.op.fla: shape {text!r}: give B,T,H,K,V with K >= {MIN_K}\n")
    for impl in impls:
      for mode in ("fwd", "fwd+bwd"):
        print(f"{shape} {impl} {mode}: {time_ms(impl, mode, shape):.3f} ms", flush=True)


if __name__ == "__main__":
  main()

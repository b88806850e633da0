"""benchmarks/results.py: the command a record stores."""

from benchmarks import results


def test_command_line_is_the_module_form_shell_quoted():
  assert (results.command_line("benchmarks.op.bench", ["--only", "D170 D760", "--shapes", "perf"])
          == "python -m benchmarks.op.bench --only 'D170 D760' --shapes perf")
  assert results.command_line("benchmarks.torch_interop", [], python="python3") == (
      "python3 -m benchmarks.torch_interop")

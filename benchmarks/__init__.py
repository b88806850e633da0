"""Benchmark scripts, grouped by what they measure (op/, step/, mqar/); each runs from the
repository root as `python -m benchmarks.GROUP.NAME` (docs/benchmarks.md)."""

"""Benchmark scripts; each runs from the repository root as `python -m benchmarks.NAME` and
imports as `benchmarks.NAME`."""

"""Benchmark scripts; each runs as `python benchmarks/NAME.py` and imports as `benchmarks.NAME`."""

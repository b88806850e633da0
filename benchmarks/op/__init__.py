"""Benchmarks of one Palimpsa op call: its speed, where its time goes, its kernels' tiles."""

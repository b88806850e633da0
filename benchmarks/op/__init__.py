"""Benchmarks of the op alone: speed side by side or across git refs, profiles, tuning, error."""

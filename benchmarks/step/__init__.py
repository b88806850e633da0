"""Benchmarks of a training step (and a decoding step) as a whole: speed, profile, compiled
memory and traffic, activation bytes, the model-size tables."""

"""Benchmarks of one training step as a whole: the language model's and the MQAR sweep's."""

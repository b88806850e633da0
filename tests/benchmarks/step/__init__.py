"""Tests of benchmarks/step/ (a package, so that test_profile.py may share its name with
benchmarks/op/'s tests)."""

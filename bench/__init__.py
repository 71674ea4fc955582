"""Benchmarks: ``python -m bench [--quick]`` (or ``make bench``) writes BENCHMARKS.md."""

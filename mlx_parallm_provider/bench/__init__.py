"""Benchmarks that print figures (never timed unit tests)."""

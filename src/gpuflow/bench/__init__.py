"""Benchmarks: every figure measured beside its baseline in the same run, saved as JSON."""

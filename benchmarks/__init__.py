"""Benchmarks that compose serving and training (drift, swap, load); `adaptive-spec bench` alone is
core-only and lives in benchmarks/bench.py."""

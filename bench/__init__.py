"""Benchmarks for sagaworker. Run with ``python -m bench`` from the repo root."""

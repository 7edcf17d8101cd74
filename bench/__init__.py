"""Benchmarks for sagaworker (issue 6). Run with ``python -m bench`` from the repo root."""

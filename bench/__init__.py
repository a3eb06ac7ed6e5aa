"""Benchmarks (``make bench``; results in docs/benchmarks.md) and the trace replay behind ``pdserve bench``.
The top layer: it may import everything, nothing imports it."""

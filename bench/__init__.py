"""Benchmarks: each module prints one JSON line and a table (``pagedserve bench NAME``)."""

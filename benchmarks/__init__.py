"""Benchmarks of the engine: each figure a ratio of two measurements from one run (``rtrain bench``)."""

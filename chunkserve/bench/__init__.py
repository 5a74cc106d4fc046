"""Benchmarks and load generation: prose corpus, datasets, ``chunkserve bench``."""

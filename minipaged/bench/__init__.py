"""Benchmarks: serving (naive vs static vs continuous batching) and, on a GPU, the kernels."""

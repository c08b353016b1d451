"""Benchmarks: the serving factorial (serving.py on baselines.py), the machine's ceilings
(hardware.py), simulated runs for pictures (simulate.py) and, on a GPU, the kernels (kernels.py)."""

"""The CPU kernels, their build and the GGUF layout they read; nothing here decides when they run.

The engine's plan (minipaged/plan.py) puts them in its table of ops and its executor
(minipaged/executor.py) runs the one fused route; only this package loads the C kernels.
model/, attention/ and kv_cache.py are the plain PyTorch the course teaches, and they import
nothing from here.

- ``attention.py``: the "cpu" attention backend (paged decode from the pages, in C).
- ``kernels.py``: the Python faces of the C kernels in ``csrc/``.
- ``gguf_blocks.py``: a GGUF file's quantized weights in the layout the matmul reads, per model.
- ``build.py``: compile and load ``csrc/kernels.c`` once per process, and say so.
"""

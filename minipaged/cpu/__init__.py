"""Every CPU fast path, behind one executor per engine.

Only the engine imports this package (``executor.make_executor``); only this package loads the
C kernels. model/, attention/ and kv_cache.py are the plain PyTorch the course teaches, and they
import nothing from here.

- ``executor.py``: the plan (stage -> implementation, and why each refused fast path was
  refused), made once per engine from its EngineConfig, and the forward pass that follows it.
- ``attention.py``: the "cpu" attention backend (paged decode from the pages, in C).
- ``kernels.py``: the Python faces of the C kernels in ``csrc/``.
- ``gguf_blocks.py``: a GGUF file's quantized weights in the layout the matmul reads.
- ``build.py``: compile and load ``csrc/kernels.c`` once per process, and say so.
"""

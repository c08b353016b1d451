"""minipaged: a small paged-attention LLM engine, written to be read and rebuilt.

The memory half (block allocator, block table, KV cache, scheduler) is pure Python plus
torch tensors; the model, kernels and engine build on it.
"""
from .block_allocator import BlockAllocator, BlockAllocatorError, OutOfBlocksError
from .block_table import BlockTable
from .config import EngineConfig, Parts
from .interfaces import BlockPool, BlockTableProtocol, PagedAttentionFn, SchedulerProtocol
from .kv_cache import KVCache, kv_bytes_per_token, num_blocks_for_budget, write_kv
from .scheduler import Scheduler, SchedulerOutput, ScheduledSeq
from .sequence import FinishReason, Sequence, SequenceStatus

__version__ = "0.1.0"

__all__ = [
    "BlockAllocator", "BlockAllocatorError", "OutOfBlocksError", "BlockTable", "KVCache",
    "kv_bytes_per_token", "num_blocks_for_budget", "write_kv", "Scheduler", "SchedulerOutput",
    "ScheduledSeq", "FinishReason", "Sequence", "SequenceStatus", "EngineConfig", "Parts",
    "BlockPool", "BlockTableProtocol", "SchedulerProtocol", "PagedAttentionFn",
]


def __getattr__(name):  # the engine pulls in the model code: import it only when asked for
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name == "LLMEngine":
        from .engine import LLMEngine
        return LLMEngine
    if name == "SamplingParams":
        from .sampling import SamplingParams
        return SamplingParams
    if name in ("StructuredOutputsParams", "GuidedDecodingParams"):
        from .sampling_params import StructuredOutputsParams
        return StructuredOutputsParams
    if name in ("BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"):
        from . import beam_search
        return getattr(beam_search, name)
    if name == "EngineArgs":
        from .engine_args import EngineArgs
        return EngineArgs
    if name in ("RequestOutput", "CompletionOutput", "RequestMetrics"):
        from . import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'minipaged' has no attribute {name!r}")

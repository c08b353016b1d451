"""vLLM's ``EngineArgs``: everything needed to build an ``LLMEngine`` from a model name, in one
object that a command line fills (``add_cli_args`` / ``from_cli_args``), as vLLM's
``llm_engine_example.py`` does::

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parser.parse_args()))

``model`` / ``tokenizer`` are paths (a GGUF file or a local Hugging Face folder; None: the default
SmolLM2); ``dtype`` is one of vLLM's names; ``seed`` seeds the engine's random numbers (unseeded
sampled requests then repeat from run to run). Every EngineConfig field (``block_size``,
``max_model_len``, ``max_num_seqs``, ``enable_prefix_caching``...) is a keyword too. A few of
vLLM's settings that mean nothing here are accepted at their harmless values (``enforce_eager``,
``trust_remote_code``, one GPU); others are refused as unsupported.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

# vLLM engine settings that change nothing in minipaged, and the values that say so
NO_EFFECT: dict[str, tuple] = {
    "enforce_eager": (True, False),  # minipaged never captures CUDA graphs
    "trust_remote_code": (True, False),  # no model code is loaded from a model folder
    "pipeline_parallel_size": (1,),
    "disable_log_stats": (True, False),
    "gpu_memory_utilization": (),  # any value: minipaged sizes its KV pool with kv_cache_bytes / num_blocks
    "tokenizer_mode": ("auto",),
    "load_format": ("auto",),
    "max_logprobs": (20,),
}


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int | None = None
    device: str | None = None
    engine_settings: dict = field(default_factory=dict)  # EngineConfig / Parts keywords

    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: Any = "auto", seed: int | None = None,
                 device: str | None = None, **settings: Any) -> None:
        from .config import split_kwargs

        self.model, self.tokenizer, self.dtype, self.seed, self.device = model, tokenizer, dtype, seed, device
        for name in [k for k in settings if k in NO_EFFECT]:
            value = settings.pop(name)
            if NO_EFFECT[name] and value not in NO_EFFECT[name]:
                raise ValueError(f"EngineArgs({name}={value!r}) is unsupported by minipaged (one device, no CUDA graphs); "
                                 f"leave it out or use {NO_EFFECT[name][0]!r}")
        split_kwargs(dict(settings))  # an unknown setting is a TypeError naming the nearest
        self.engine_settings = settings

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        from .dtypes import CHOICES
        from .flags import add_engine_flags

        parser.add_argument("--model", default=None, help="a GGUF file or a local Hugging Face folder (default: SmolLM2-135M-Instruct)")
        parser.add_argument("--tokenizer", default=None, help="a tokenizer folder or file (default: the model's own)")
        parser.add_argument("--dtype", default="auto", choices=list(CHOICES), help="default auto: float32")
        parser.add_argument("--seed", type=int, default=None, help="seed the engine's random numbers")
        parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
        add_engine_flags(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        from .flags import engine_kwargs

        return cls(model=args.model, tokenizer=getattr(args, "tokenizer", None), dtype=getattr(args, "dtype", "auto"),
                   seed=getattr(args, "seed", None), device=getattr(args, "device", None), **engine_kwargs(args))

    def load(self) -> tuple[Any, Any]:
        """(model, tokenizer) as these arguments ask (LLMEngine.from_engine_args builds the engine on them)."""
        import torch

        from .dtypes import resolve_dtype
        from .model import load_model

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model, tok = load_model(self.model, dtype=resolve_dtype(self.dtype), device=device)
        if self.tokenizer is not None:
            tok = load_tokenizer(self.tokenizer)
        if self.seed is not None:
            torch.manual_seed(self.seed)
        return model, tok


def load_tokenizer(path: Any):
    """A tokenizer from a path, as ``LLM(tokenizer=...)`` and ``EngineArgs(tokenizer=...)`` take it:
    a local Hugging Face folder (tokenizer.json) or a GGUF file (its vocabulary). A tokenizer object
    (anything with ``encode`` and ``decode``) is returned as it is. minipaged never downloads, so a
    Hub name that is not a local path is a FileNotFoundError saying so."""
    from pathlib import Path

    if hasattr(path, "encode") and hasattr(path, "decode") and not isinstance(path, (str, bytes)):
        return path
    from .model import DEFAULT_ALIASES, default_model_path

    if str(path) in DEFAULT_ALIASES:
        path = default_model_path()
    p = Path(path).expanduser()
    if p.is_dir():
        from .model.tokenizer import Tokenizer

        return Tokenizer.from_hf_folder(p)
    if p.is_file() and p.suffix == ".gguf":
        from .model.gguf_loader import _Meta, open_gguf, read_tokenizer

        return read_tokenizer(_Meta(open_gguf(p), p), p)
    raise FileNotFoundError(
        f"tokenizer {str(path)!r} is not a local folder or GGUF file: minipaged loads tokenizers from disk only "
        "(a Hugging Face folder with tokenizer.json, or a .gguf file); download it first, or leave tokenizer out "
        "to use the model's own"
    )

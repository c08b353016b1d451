"""The model's default sampling settings: ``LLM(generation_config="auto" | "vllm" | path)``.

A Hugging Face model folder may ship ``generation_config.json`` with the sampling its authors
recommend (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
``max_new_tokens``). As in vLLM:

- ``"auto"`` (the default): those of the model's folder, where it ships the file (a GGUF file
  ships none: nothing changes);
- ``"vllm"``: none, SamplingParams' own defaults;
- a path: a folder holding ``generation_config.json``, or the file itself.

They become the defaults of ``LLM.get_default_sampling_params()``, which ``generate`` and ``chat``
use when given no SamplingParams.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# generation_config.json's names -> SamplingParams' names
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(source: Any, model: Any = None) -> dict:
    """The SamplingParams keywords ``source`` asks for ({}: none). ``model``: what LLM was given
    (a folder or file path is searched when ``source`` is "auto")."""
    if source is None or source == "vllm":
        return {}
    if source == "auto":
        if not isinstance(model, (str, os.PathLike)):
            return {}
        path = Path(model).expanduser()
        path = path / "generation_config.json" if path.is_dir() else path.with_name("generation_config.json")
        if not path.is_file():
            return {}
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        path = path / "generation_config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"generation_config={str(source)!r}: no generation_config.json there; give a folder that "
                             "holds one, the file itself, \"auto\" (the model's own) or \"vllm\" (none)")
    else:
        raise ValueError(f"generation_config must be \"auto\", \"vllm\" or a path, got {source!r}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"generation_config {path}: not readable JSON ({e})") from None
    if raw.get("do_sample") is False:  # transformers' greedy switch
        raw = {**raw, "temperature": 0.0}
    return {ours: raw[theirs] for theirs, ours in FIELDS.items() if raw.get(theirs) is not None}


__all__ = ["FIELDS", "read_generation_config"]

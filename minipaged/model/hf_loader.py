"""Read a local Hugging Face model folder: config.json, *.safetensors (one file or shards), tokenizer.

Owns finding and checking the files; the weights keep Hugging Face's names, which the model
takes as they are. It never downloads: fetch a model first (``huggingface-cli download ...``)
and pass its folder.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import LlamaConfig
from .errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError
from .tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptModelError(f"{path} is not valid JSON (truncated or corrupt?): {e}") from e


def read_config(folder: Path) -> LlamaConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"{folder} has no config.json, so it is not a Hugging Face model folder")
    cfg = _read_json(path)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} ({cfg.get('architectures')}) is not supported; "
            f"minipaged runs {list(SUPPORTED_MODEL_TYPES)} (SmolLM is 'llama')"
        )
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():  # chat models often list extra stop ids here only
        gen_eos = _read_json(gen_path).get("eos_token_id")
        if gen_eos is not None:
            own = cfg.get("eos_token_id")
            own = [] if own is None else [own] if isinstance(own, int) else list(own)
            cfg = dict(cfg, eos_token_id=own + ([gen_eos] if isinstance(gen_eos, int) else list(gen_eos)))
    try:
        return LlamaConfig.from_hf_dict(cfg, name=folder.name)
    except KeyError as e:
        raise CorruptModelError(f"{path} lacks the key {e}") from e


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: those the shard index names, else every ``*.safetensors`` in the folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(f"{index} names shards that are not in {folder}: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pth")]
        hint = f" (found {other}: convert them with save_pretrained(..., safe_serialization=True))" if other else ""
        raise ModelNotFoundError(f"{folder} has no *.safetensors weight files{hint}")
    return files


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        try:
            weights.update(load_file(str(f)))
        except Exception as e:  # SafetensorError on a short or foreign file
            raise CorruptModelError(
                f"{f} ({f.stat().st_size / 2**20:.1f} MiB) is not a readable safetensors file: {e}. "
                "A truncated download is the usual cause: download it again."
            ) from e
    return weights


def load_hf_folder(folder: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], Tokenizer]:
    """(config, state dict in Hugging Face names, tokenizer) from a local model folder."""
    folder = Path(folder)
    config = read_config(folder)
    tokenizer = Tokenizer.from_hf_folder(folder, config_eos_token_ids=config.eos_token_ids)
    config.eos_token_ids = tokenizer.eos_token_ids or config.eos_token_ids
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
    return config, read_weights(folder), tokenizer

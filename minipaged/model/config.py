"""The shape of a Llama-family model: one dataclass, filled from a GGUF header or a config.json.

Owns the numbers (layers, heads, sizes, RoPE base, special token ids) and the checks that
they fit together. It knows nothing about weights or files; the loaders fill it in.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import UnsupportedModelError


@dataclass
class LlamaConfig:
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2 puts a bias on q/k/v (never on o_proj)
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = field(default=(2,))
    name: str = "llama"

    def __post_init__(self) -> None:
        if isinstance(self.eos_token_ids, int):
            self.eos_token_ids = (self.eos_token_ids,)
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs every KV head to serve the same number of query heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"{self.name}: head_dim={self.head_dim} is odd; RoPE rotates pairs of dimensions")

    @property
    def kv_dim(self) -> int:
        """Width of one token's K (or V) in one layer: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Weights the model holds, counting a tied embedding once."""
        h, kv, q = self.hidden_size, self.kv_dim, self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "hf") -> "LlamaConfig":
        """From a Hugging Face ``config.json`` (Llama, SmolLM, Qwen2, Mistral without sliding window)."""
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default"):
            raise UnsupportedModelError(
                f"{name}: RoPE scaling {rope_type!r} is not implemented in minipaged (only plain RoPE); "
                "pick a model whose config.json has no rope_scaling"
            )
        unsupported = {
            "mlp_bias": cfg.get("mlp_bias", False),
            "use_sliding_window": cfg.get("use_sliding_window", False),
            "hidden_act": cfg.get("hidden_act", "silu") not in ("silu", "swish"),
        }
        for key, bad in unsupported.items():
            if bad:
                raise UnsupportedModelError(
                    f"{name}: config.json sets {key}={cfg.get(key)!r}, which minipaged's Llama does not implement"
                )
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        model_type = cfg.get("model_type", "llama")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rope_theta=float(theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2's config.json does not say so, but its q/k/v always carry a bias.
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            name=name,
        )

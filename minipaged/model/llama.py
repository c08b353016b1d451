"""A Llama-family decoder (Llama, SmolLM, Qwen2) that keeps its K/V in the paged cache.

Owns the maths of one forward pass over a flat batch of new tokens: embeddings, RoPE,
grouped-query attention through a backend, SwiGLU MLP, RMSNorm, and the LM head. It does not
decide which tokens run or where their K/V go: the engine hands it ``positions`` and an
``AttentionMetadata`` (slot mapping, block tables) already made. It is plain PyTorch on plain
``nn.Linear`` layers. Every stage calls its kernel from a table of ops (model/ops.py): this file's
plain table by default, or the one the engine's plan chose (C kernels, GGUF blocks; minipaged/plan.py),
so this forward is what runs either way. The one fused route, a decode step's layers in one C call,
is tested bit for bit against this forward on the same table.

Shapes: N = new tokens of all sequences packed together, H = num_heads, H_kv = num_kv_heads,
D = head_dim, C = hidden_size. Module names follow Hugging Face's, so its weights copy straight in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import TORCH, AttentionBackend, AttentionMetadata
from ..kv_cache import KVCache
from .config import LlamaConfig
from .ops import Op, Ops


@dataclass(frozen=True)
class ModelSource:
    """Where a loaded model's weights came from (``load_model`` sets ``model.source``): a GGUF
    file or a Hugging Face folder. An engine's executor may read a GGUF file's quantized blocks
    from it; ``cache`` holds what it read, shared by every engine on this model."""

    path: str
    format: str  # "gguf" or "folder"
    cache: dict = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.cache is None:
            object.__setattr__(self, "cache", {})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C) -> (N, C)
        # fp32 statistics even for a bf16 model: the mean of squares overflows/rounds badly otherwise.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, each (max_positions, D), in Hugging Face's rotate_half layout.

    Dimension i and i + D/2 form one rotating pair, turning at frequency theta^(-2i/D).
    """
    # device="cpu" on purpose: a model built on the meta device (to skip random init) still gets real tables.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    pos = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
    freqs = torch.outer(pos, inv_freq)  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate q or k by its token's position. x: (N, heads, D); cos, sin: (N, D)."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)  # (N, 1, D)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # "rotate_half"
    return x * cos + rotated * sin


def _add_rmsnorm(norm: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + y  # the residual stream
    return norm(x), x


def plain_ops(backend: AttentionBackend = TORCH) -> Ops:
    """The plain table: PyTorch on the model's own modules (so their hooks run), attention through
    ``backend``. What ``forward`` runs when no table is given."""
    torch_ = {"elementwise": "torch"}
    return Ops(
        linear=Op(lambda m, x: m(x), {"linear": "torch (F.linear)"}),
        rmsnorm=Op(lambda norm, x: norm(x), torch_),
        add_rmsnorm=Op(_add_rmsnorm, torch_),
        rope=Op(lambda q, k, cos, sin: (apply_rope(q, cos, sin), apply_rope(k, cos, sin)), torch_),
        silu_mul=Op(lambda gate, up: F.silu(gate) * up, torch_),  # SwiGLU's gate
        write_kv=Op(backend.write_kv, {"kv_write": f"{backend.name} write_kv"}),
        attention=Op(backend.forward, {"decode_attention": backend.name, "prefill_attention": backend.name}),
    )


PLAIN_OPS = plain_ops(TORCH)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (N, C)
        cos: torch.Tensor,  # (N, D)
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # (num_blocks, block_size, H_kv, D): this layer's pages
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        ops: Ops = PLAIN_OPS,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = ops.linear(self.q_proj, x).view(n, self.num_heads, self.head_dim)  # (N, H, D)
        k = ops.linear(self.k_proj, x).view(n, self.num_kv_heads, self.head_dim)  # (N, H_kv, D)
        v = ops.linear(self.v_proj, x).view(n, self.num_kv_heads, self.head_dim)  # (N, H_kv, D)
        q, k = ops.rope(q, k, cos, sin)
        # K is cached after RoPE, so a cached token never needs rotating again.
        ops.write_kv(k_cache, v_cache, k, v, attn.slot_mapping)
        o = ops.attention(q, k_cache, v_cache, attn, self.scale)  # (N, H, D): each new token over its whole context
        return ops.linear(self.o_proj, o.reshape(n, self.num_heads * self.head_dim))  # (N, C)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: Ops = PLAIN_OPS) -> torch.Tensor:  # (N, C) -> (N, C), via (N, I)
        gate, up = ops.linear(self.gate_proj, x), ops.linear(self.up_proj, x)  # (N, I) each
        return ops.linear(self.down_proj, ops.silu_mul(gate, up))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, k_cache, v_cache, attn, ops: Ops = PLAIN_OPS) -> torch.Tensor:  # (N, C) -> (N, C)
        a = self.self_attn(ops.rmsnorm(self.input_layernorm, x), cos, sin, k_cache, v_cache, attn, ops)
        h, x = ops.add_rmsnorm(self.post_attention_layernorm, x, a)  # x = x + a; h = its norm
        return x + self.mlp(h, ops)


class LlamaModel(nn.Module):
    """The decoder stack plus LM head. ``forward`` gives hidden states; ``compute_logits`` the logits."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # Its own init only off the meta device (where load_model builds): a normal_ on a meta
        # tensor goes through PyTorch's Python decompositions, whose first use imports
        # torch._dynamo (seconds). The same draws as nn.Embedding's own init otherwise.
        emb = torch.empty(config.vocab_size, config.hidden_size)
        if emb.device.type != "meta":
            nn.init.normal_(emb)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=emb)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(config.head_dim, config.max_position_embeddings, config.rope_theta)
        # Not weights: never saved, rebuilt from the config.
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_positions, D)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.requires_grad_(False)  # inference only
        self.source: ModelSource | None = None  # set by load_model

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # (N,) int64: the new tokens of every scheduled sequence, packed
        positions: torch.Tensor,  # (N,) int64: each token's position in its own sequence
        kv_cache: KVCache,
        attn: AttentionMetadata,
        backend: AttentionBackend = TORCH,
        ops: Ops | None = None,
    ) -> torch.Tensor:
        """Run the new tokens through every layer, storing their K/V; returns (N, C) after the final norm.

        Every stage calls its kernel from ``ops`` (an engine passes its plan's table); without one,
        the plain table with every layer attending through ``backend``."""
        if ops is None:
            ops = PLAIN_OPS if backend is TORCH else plain_ops(backend)
        x = self.embed_tokens(input_ids)  # (N, C)
        # One lookup for all layers; positions past max_position_embeddings raise an IndexError here.
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (N, D)
        for layer, k_cache, v_cache in zip(self.layers, kv_cache.k, kv_cache.v):
            x = layer(x, cos, sin, k_cache, v_cache, attn, ops)
        return ops.rmsnorm(self.norm, x)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, ops: Ops = PLAIN_OPS) -> torch.Tensor:
        """(M, C) -> (M, vocab) float32. Only for the rows that get sampled: the head is the widest matmul."""
        return ops.linear(self.lm_head, hidden).float()

    def linears(self) -> list[nn.Linear]:
        """Every projection of every layer, and the LM head."""
        return [m for m in self.modules() if isinstance(m, nn.Linear)]

    def new_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None, device=None
    ) -> KVCache:
        """An empty paged cache shaped for this model (dtype and device default to the weights')."""
        w = self.embed_tokens.weight
        c = self.config
        return KVCache(
            c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype or w.dtype, device or w.device
        )

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Take weights named as Hugging Face names them (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``).

        Every weight must be there with the right shape (a tied model needs no ``lm_head.weight``).
        A model built on the meta device gets the given tensors themselves, not copies.
        """
        self.source = None  # the weights are no longer the file's
        own = {}
        for name, tensor in state_dict.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # some checkpoints save RoPE's frequencies; ours come from the config
            own[name.removeprefix("model.")] = tensor
        if self.config.tie_word_embeddings:
            own.pop("lm_head.weight", None)  # tied: the head is the embedding
        params = dict(self.named_parameters())  # a tied head appears once, as embed_tokens.weight
        missing, unexpected = sorted(params.keys() - own.keys()), sorted(own.keys() - params.keys())
        if missing or unexpected:
            raise KeyError(
                f"weights do not fit {self.config.name}: missing {missing[:6]}{' ...' if len(missing) > 6 else ''}, "
                f"unexpected {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}. "
                "Check tie_word_embeddings and attention_bias in the config."
            )
        for key, tensor in own.items():
            param = params[key]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{key}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
            if param.is_meta:
                module_name, _, leaf = key.rpartition(".")
                new = nn.Parameter(tensor.to(param.dtype), requires_grad=False)
                setattr(self.get_submodule(module_name), leaf, new)
            else:
                param.copy_(tensor)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

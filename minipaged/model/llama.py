"""A Llama-family decoder (Llama, SmolLM, Qwen2) that keeps its K/V in the paged cache.

Owns the maths of one forward pass over a flat batch of new tokens: embeddings, RoPE,
grouped-query attention through a backend, SwiGLU MLP, RMSNorm, and the LM head. It does not
decide which tokens run or where their K/V go: the engine hands it ``positions`` and an
``AttentionMetadata`` (slot mapping, block tables) already made.

Shapes: N = new tokens of all sequences packed together, H = num_heads, H_kv = num_kv_heads,
D = head_dim, C = hidden_size. Module names follow Hugging Face's, so its weights copy straight in.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module

from ..attention import TORCH, AttentionBackend, AttentionMetadata, cpu_kernels
from ..kv_cache import KVCache
from .config import LlamaConfig


def mkl_packing_available() -> bool:
    """PyTorch's MKL packed GEMM (what torch.compile's CPU freezing uses for fp32 linears)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _version(t: torch.Tensor) -> int | None:
    """A tensor's in-place-change counter (None for an inference tensor, which has none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _signature(t: torch.Tensor) -> tuple:
    """What must not change for a copy made from ``t`` to stay good: the tensor, its memory, its
    in-place-change counter (``param.data = ...`` and ``.to()`` swap the memory, ``copy_`` bumps
    the counter)."""
    return (t, t.data_ptr(), t.dtype, _version(t))


def _unchanged(t: torch.Tensor, signature: tuple) -> bool:
    source, ptr, dtype, version = signature
    return t is source and t.data_ptr() == ptr and t.dtype == dtype and (version is None or _version(t) == version)


# Batches of at most this many rows go through the GGUF blocks (cpu_kernels.qmatmul) when a
# Linear keeps them and use_gguf_blocks is on. On this project's machine that beats MKL's GEMM
# on the fp32 copy at every size, prefills included (scripts/gguf_matmul_crossover.py, its "body
# only" column), so the limit is above any step the engine makes. Where your machine's table says
# MKL wins above some size, call model.use_gguf_blocks(rows) with that size.
GGUF_MATMUL_MAX_ROWS = 1 << 16


class Linear(nn.Linear):
    """An ``nn.Linear`` that can keep two faster forms of its weight, for the CPU in fp32:

    - MKL-packed copies for given batch sizes (``pack``). MKL's GEMM repacks the weight into its
      blocked layout on every call; at decode-sized batches (tens of rows) that repacking is a
      large part of the call. With a packed copy for a batch of exactly M rows
      (``LlamaModel.pack_weights``), an (M, in) input skips it, at the same result.
    - The GGUF file's quantized blocks (``keep_blocks``, see model/gguf_blocks.py). A batch of at
      most ``gguf_rows`` rows multiplies straight from them: the same fp32 weights rebuilt block
      by block, the same fp32 maths, a fifth of the bytes read.

    Any other batch runs the plain ``nn.Linear``. Both forms are checked against the weight
    they came from before each use: a weight replaced or changed in place is never served from
    a stale copy. Hooks and state dicts see an ordinary ``nn.Linear``: the copies are neither
    parameters nor buffers."""

    packed: dict[int, torch.Tensor]

    @torch.no_grad()
    def pack(self, batch_sizes) -> int:
        """Keep packed copies of the weight for batches of exactly these row counts, replacing any
        earlier ones (``pack(())`` drops them); returns about the bytes they take. The caller
        checks that the weight is fp32 on a CPU with MKL (``mkl_packing_available``)."""
        sizes = sorted({int(m) for m in batch_sizes if int(m) >= 1})
        self.__dict__.pop("packed", None)
        self.__dict__.pop("packed_from", None)
        if not sizes:
            return 0
        self.__dict__["packed"] = {m: torch.ops.mkl._mkl_reorder_linear_weight(self.weight, m) for m in sizes}
        self.__dict__["packed_from"] = _signature(self.weight)
        return self.weight.numel() * 4 * len(sizes)  # MKL's packed layout is about the weight's size

    def keep_blocks(self, blocks) -> None:
        """Keep ``blocks`` (a GGUFBlocks of this very weight, or None to drop them). They are
        used for batches of at most ``gguf_rows`` rows (0, the default, until set)."""
        self.__dict__.pop("blocks", None)
        self.__dict__.pop("blocks_from", None)
        if blocks is None:
            return
        if tuple(blocks.shape) != tuple(self.weight.shape):
            raise ValueError(f"blocks of a {tuple(blocks.shape)} weight cannot stand for this {tuple(self.weight.shape)} one")
        self.__dict__["blocks"] = blocks
        self.__dict__["blocks_from"] = _signature(self.weight)

    @property
    def blocks(self):
        """The GGUF blocks kept (None when there are none, or the weight has changed since)."""
        blocks = self.__dict__.get("blocks")
        if blocks is None or not _unchanged(self.weight, self.__dict__["blocks_from"]):
            return None
        return blocks

    gguf_rows: int = 0  # batches of at most this many rows use the blocks (LlamaModel.use_gguf_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu":
            if 1 <= x.shape[0] <= self.gguf_rows and cpu_kernels.qmatmul_fast():
                blocks = self.blocks
                if blocks is not None and not (x.requires_grad and torch.is_grad_enabled()):
                    y = cpu_kernels.qmatmul(x, blocks)
                    return y if self.bias is None else y.add_(self.bias)
            packs = self.__dict__.get("packed")
            if packs:
                w = packs.get(x.shape[0])
                # a pack is only good for the very weight it was made from, unchanged since
                if w is not None and _unchanged(self.weight, self.__dict__["packed_from"]):
                    return torch.ops.mkl._mkl_linear(x, w, self.weight, self.bias, x.shape[0])
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C) -> (N, C)
        if x.dim() == 2 and cpu_kernels.fused_ops_apply(x):
            return cpu_kernels.rmsnorm(x, self.weight, self.eps)  # one pass in C, the same maths
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


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.kv_dim, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.kv_dim, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (N, C)
        cos: torch.Tensor,  # (N, D)
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # (num_blocks, block_size, H_kv, D): this layer's pages
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)  # (N, H, D)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # (N, H_kv, D)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)  # (N, H_kv, D)
        if cpu_kernels.fused_ops_apply(q) and cos.is_contiguous() and cos.dtype == q.dtype:
            cpu_kernels.rope_(q, cos, sin), cpu_kernels.rope_(k, cos, sin)  # in place, one pass each
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # K is cached after RoPE, so a cached token never needs rotating again.
        backend.write_kv(k_cache, v_cache, k, v, attn.slot_mapping)
        o = backend.forward(q, k_cache, v_cache, attn, self.scale)  # (N, H, D): each new token over its whole context
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))  # (N, C)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C) -> (N, C), via (N, intermediate)
        gate = self.gate_proj(x)
        if cpu_kernels.fused_ops_apply(gate):
            return self.down_proj(cpu_kernels.silu_mul(gate, self.up_proj(x)))  # SwiGLU, one pass in C
        return self.down_proj(F.silu(gate) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, k_cache, v_cache, attn, backend) -> torch.Tensor:  # (N, C) -> (N, C)
        a = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, attn, backend)
        norm = self.post_attention_layernorm
        if type(norm) is RMSNorm and x.dim() == 2 and cpu_kernels.fused_ops_apply(a):
            x = x.clone()  # the residual stream; the caller's x is left as it was
            h = cpu_kernels.rmsnorm(a, norm.weight, norm.eps, residual=x)  # x += a, then its norm: one pass
            return x.add_(self.mlp(h))
        x = x + a
        return x + self.mlp(norm(x))


def _no_hooks(m: nn.Module) -> bool:
    return not (m._forward_hooks or m._forward_pre_hooks)


def _fusable_parts(layer: nn.Module) -> tuple | None:
    """A layer's norms and linear layers when it is minipaged's own DecoderLayer, built of
    minipaged's own parts with no hooks and fp32 norm weights (what decode_layers computes
    exactly); None otherwise."""
    if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP:
        return None
    a, mlp = layer.self_attn, layer.mlp
    parts = (layer.input_layernorm, layer.post_attention_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj,
             mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not (_no_hooks(layer) and _no_hooks(a) and _no_hooks(mlp)):
        return None
    for m in parts:
        if type(m) not in (RMSNorm, Linear) or not _no_hooks(m):
            return None
    for w in [norm.weight for norm in parts[:2]] + [lin.bias for lin in parts[2:] if lin.bias is not None]:
        if w.dtype != torch.float32 or not w.is_contiguous() or w.device.type != "cpu":
            return None
    return parts


def _watch(model: nn.Module, kv_cache: KVCache) -> tuple:
    """What a decode plan was built from, to check cheaply before each step: every module link
    from the model down to each norm and linear layer (a replaced part), every module's hooks,
    each weight's parameter object, memory and change counter and each linear layer's blocks,
    and where each layer's pages lie (any cache whose pages lie there is served by the plan)."""
    links, modules, tensors, linears = [], [], [], []
    layers = model._modules["layers"]
    links.append((model._modules, "layers", layers))
    for name, layer in layers._modules.items():
        links.append((layers._modules, name, layer))
        for parent in (layer, layer.self_attn, layer.mlp):
            modules.append(parent)
            for child_name, child in parent._modules.items():
                links.append((parent._modules, child_name, child))
                if isinstance(child, (Linear, RMSNorm)):
                    modules.append(child)
                    for pname in ("weight", "bias"):
                        t = child._parameters.get(pname)
                        tensors.append((child._parameters, pname, t, None if t is None else t.data_ptr(),
                                        None if t is None else _version(t)))
                if isinstance(child, Linear):
                    linears.append((child, child.__dict__.get("blocks")))
                elif isinstance(child, RMSNorm):
                    linears.append((child, child.eps))
    modules.append(model.embed_tokens)
    # the pages by address and shape only: holding them would keep a finished engine's cache alive
    pages = [(t.data_ptr(), t.shape) for t in kv_cache.k + kv_cache.v]
    return links, modules, tensors, linears, pages, len(kv_cache.k), len(kv_cache.v)


def _watch_holds(watch: tuple, n: int, kv_cache: KVCache) -> bool:
    links, modules, tensors, linears, pages, nk, nv = watch
    if len(kv_cache.k) != nk or len(kv_cache.v) != nv:
        return False
    for d, name, obj in links:
        if d.get(name) is not obj:
            return False
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks:
            return False
    for d, name, t, ptr, version in tensors:
        if d.get(name) is not t or (t is not None and (t.data_ptr() != ptr or _version(t) != version)):
            return False
    for m, kept in linears:
        if type(m) is Linear:
            if m.__dict__.get("blocks") is not kept or m.gguf_rows < n:
                return False
        elif m.eps != kept:
            return False
    for t, (ptr, shape) in zip(kv_cache.k + kv_cache.v, pages):
        if t.data_ptr() != ptr or t.shape != shape:
            return False
    return True


class LlamaModel(nn.Module):
    """The decoder stack plus LM head. ``forward`` gives hidden states; ``compute_logits`` the logits."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(config.head_dim, config.max_position_embeddings, config.rope_theta)
        # Not weights: never saved, rebuilt from the config.
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_positions, D)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.requires_grad_(False)  # inference only
        self.backend: AttentionBackend = TORCH  # bound once by the engine: bind_attention()

    def bind_attention(self, backend: AttentionBackend) -> None:
        """Every layer attends through ``backend`` from now on (the engine does this once, at start)."""
        self.backend = backend

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # (N,) int64: the new tokens of every scheduled sequence, packed
        positions: torch.Tensor,  # (N,) int64: each token's position in its own sequence
        kv_cache: KVCache,
        attn: AttentionMetadata,
        backend: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """Run the new tokens through every layer, storing their K/V; returns (N, C) after the final norm.

        Attention goes through the bound backend (``bind_attention``); ``backend`` overrides it for
        this call only (tests drive the model without an engine this way)."""
        backend = backend or self.backend
        x = self.embed_tokens(input_ids)  # (N, C)
        # One lookup for all layers; positions past max_position_embeddings raise an IndexError here.
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (N, D)
        plan = self._decode_plan(x, attn, kv_cache, backend)
        if plan is not None:  # a step of decodes only: every layer in one C call, the same maths
            return self.norm(cpu_kernels.decode_layers(plan, x, cos, sin, attn, self.layers[0].self_attn.scale))
        for layer, k_cache, v_cache in zip(self.layers, kv_cache.k, kv_cache.v):
            x = layer(x, cos, sin, k_cache, v_cache, attn, backend)
        return self.norm(x)

    # A step whose every token is a decode runs all the layers in one C call
    # (cpu_kernels.decode_layers) where it can stand in for them exactly: fp32 on a CPU with the
    # fast GGUF matmul, every linear layer multiplying from its blocks at this batch, minipaged's
    # own layer classes with no hooks, and attention through the "torch" backend (a backend of
    # your own is always called). False: always layer by layer (the same bits, slower).
    fused_decode: bool = True

    def _decode_plan(self, x: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache, backend) -> "cpu_kernels.DecodeLayers | None":
        n = x.shape[0]
        if (not self.fused_decode or backend != TORCH or attn.num_decodes != n or attn.context_lens.shape[0] != n
                or _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks
                or not cpu_kernels.qmatmul_fast() or not cpu_kernels.fused_ops_apply(x)
                or not kv_cache.k or not cpu_kernels.applies(x, kv_cache.k[0], kv_cache.v[0])
                or not _no_hooks(self.embed_tokens)):  # x is updated in place: it must be the embedding's own
            return None
        cached = self.__dict__.get("_decode_plan_cache")
        if cached is not None and _watch_holds(cached[1], n, kv_cache):
            return cached[0]  # nothing it was built from has changed
        if len(kv_cache.k) != len(self.layers) or len(kv_cache.v) != len(self.layers):
            return None
        for layer, k_cache, v_cache in zip(self.layers, kv_cache.k, kv_cache.v):
            parts = _fusable_parts(layer)
            if parts is None or not cpu_kernels.applies(x, k_cache, v_cache):
                return None
            if any(isinstance(m, Linear) and (m.blocks is None or n > m.gguf_rows) for m in parts):
                return None
        eps = {layer.input_layernorm.eps for layer in self.layers} | {layer.post_attention_layernorm.eps for layer in self.layers}
        if len(eps) != 1:
            return None
        c = self.config
        layers = []
        for layer, k_cache, v_cache in zip(self.layers, kv_cache.k, kv_cache.v):
            a, mlp = layer.self_attn, layer.mlp
            layers.append({"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                           **{name: (lin.blocks, lin.bias) for name, lin in (
                               ("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj),
                               ("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj))},
                           "k_cache": k_cache, "v_cache": v_cache})
        plan = cpu_kernels.DecodeLayers(layers, eps.pop(), {"C": c.hidden_size, "H": c.num_heads, "H_kv": c.num_kv_heads,
                                                            "D": c.head_dim, "I": c.intermediate_size})
        self.__dict__["_decode_plan_cache"] = (plan, _watch(self, kv_cache))
        return plan

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M, C) -> (M, vocab) float32. Only for the rows that get sampled: the head is the widest matmul."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """``compute_logits(hidden).argmax(-1)`` without making the logits, where the LM head
        multiplies from its GGUF blocks (fp32 on a CPU, 9 to gguf_rows rows, no hooks on the
        head): the same products, so the same tokens. None elsewhere: compute the logits then."""
        head = self.lm_head
        if (not (8 < hidden.shape[0] <= head.gguf_rows) or type(head) is not Linear or head.bias is not None
                or not _no_hooks(head) or _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks
                or hidden.dtype != torch.float32 or hidden.device.type != "cpu"):
            return None
        blocks = head.blocks
        return None if blocks is None else cpu_kernels.qmatmul_argmax(hidden, blocks)

    def linears(self) -> list[Linear]:
        """Every projection of every layer, and the LM head."""
        return [m for m in self.modules() if isinstance(m, Linear)]

    @torch.no_grad()
    def pack_weights(self, batch_sizes) -> int:
        """Keep MKL-packed weights for batches of exactly these row counts (replacing any earlier
        set); returns the bytes they take. Only for fp32 weights on a CPU with MKL; otherwise a
        no-op that returns 0. ``pack_weights(())`` drops them. Results do not change."""
        w0 = self.embed_tokens.weight
        usable = w0.device.type == "cpu" and w0.dtype == torch.float32 and mkl_packing_available()
        return sum(module.pack(batch_sizes if usable else ()) for module in self.linears())

    def keep_gguf_blocks(self, blocks: Mapping[str, object]) -> int:
        """Give each linear layer its GGUF blocks (names as in ``load_hf_state_dict``, e.g.
        ``model.layers.0.mlp.up_proj.weight``; a layer not named keeps none); returns how many
        layers got them. They are used once ``use_gguf_blocks`` allows it."""
        names = {"lm_head.weight": self.lm_head}
        for name, module in self.named_modules():
            if isinstance(module, Linear) and module is not self.lm_head:
                names[f"model.{name}.weight"] = module
        unknown = sorted(set(blocks) - set(names))
        if unknown:
            raise KeyError(f"no linear layer is named {unknown[:4]}")
        for name, module in names.items():
            module.keep_blocks(blocks.get(name))
        return sum(name in blocks for name in names)

    def use_gguf_blocks(self, max_rows: int | None = GGUF_MATMUL_MAX_ROWS) -> int:
        """Batches of at most ``max_rows`` rows multiply from the kept GGUF blocks (fp32 on a CPU,
        where ``cpu_kernels.qmatmul_fast()``); 0 or None: never. Returns how many layers will."""
        rows = int(max_rows or 0)
        if rows < 0:
            raise ValueError(f"max_rows must be >= 0, got {max_rows!r}")
        for module in self.linears():
            module.gguf_rows = rows
        if not rows or not cpu_kernels.qmatmul_fast():
            return 0
        return sum(m.blocks is not None for m in self.linears())

    def gguf_blocks_info(self) -> dict:
        """Which layers keep GGUF blocks, and for which batches they are used."""
        kept = [m for m in self.linears() if m.blocks is not None]
        rows = self.lm_head.gguf_rows
        return {"layers": len(kept), "of": len(self.linears()), "max_rows": rows,
                "in_use": bool(kept) and rows > 0 and cpu_kernels.qmatmul_fast(),
                "bytes": sum(m.blocks.nbytes for m in kept),
                "stream_bytes": sum(m.blocks.stream_bytes for m in kept),  # read once per token at batch 1
                "kinds": sorted({m.blocks.kind for m in kept})}

    def packed_batch_sizes(self) -> list[int]:
        """The batch sizes ``pack_weights`` last packed for (empty when none)."""
        packed = self.lm_head.__dict__.get("packed") or {}
        return sorted(packed)

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
        self.pack_weights(())  # packed copies of the old weights would be stale
        for module in self.linears():
            module.keep_blocks(None)  # and so would GGUF blocks
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

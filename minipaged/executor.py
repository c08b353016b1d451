"""One executor per engine: runs each step as the engine's plan (minipaged/plan.py) says.

Owns the step's forward pass and the next token's inputs, on any device: the model's own forward
on the plan's table of ops (model/llama.py is what runs), or, for a step of decodes where the plan
allows, the one fused route, every layer in one C call (cpu.kernels.decode_layers), which holds
the addresses of the engine's KV pages and GGUF blocks. Every derived copy a fast path needs
belongs to the plan and this executor, never to the model, so two engines on one model can hold
different settings at once. Never touches the scheduler, the block pool or the sampler's rules.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .attention import AttentionBackend, AttentionMetadata
from .kv_cache import KVCache
from .plan import Plan, build_plan


def scratch_pass(model: nn.Module, token_ids: list[int], block_size: int, device: torch.device):
    """The inputs of one pass of ``token_ids`` as a single prompt into a cache of its own (prompt
    logprobs): (input_ids, positions, the scratch cache, its metadata)."""
    n = len(token_ids)
    nblocks = -(-n // block_size)
    cache = model.new_kv_cache(nblocks, block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        block_tables=torch.arange(nblocks, dtype=torch.int32, device=device)[None],
        context_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
    )
    return torch.tensor(token_ids, device=device), torch.arange(n, device=device), cache, meta


class Executor:
    """Runs one engine's steps as its plan says. ``forward`` gives the hidden states of a step's
    new tokens; ``greedy_tokens`` / ``compute_logits`` the next token's inputs. ``last_route``
    names what the last step ran: "whole_step" (every layer in the one C call), "layers" (one
    model.forward that runs the layers one by one, each op from the plan's table: the plan's
    ``whole_step_decode`` "off (layer by layer)") or "model" (the model's own forward, plain table)."""

    def __init__(self, plan: Plan, model: nn.Module, kv_cache: KVCache) -> None:
        self.plan, self.model, self.kv_cache = plan, model, kv_cache
        self.backend: AttentionBackend = plan.attention
        self._decode_layers = self._build_decode_layers() if plan.whole_step else None
        self.last_route = None

    def _build_decode_layers(self):
        from .cpu import kernels

        model, c, blocks = self.model, self.model.config, self.plan.blocks
        eps = {ly.input_layernorm.eps for ly in model.layers} | {ly.post_attention_layernorm.eps for ly in model.layers}
        if len(eps) != 1:
            raise ValueError("the whole-step decode needs one RMSNorm eps for every layer")
        layers = []
        for layer, k_cache, v_cache in zip(model.layers, self.kv_cache.k, self.kv_cache.v):
            a, mlp = layer.self_attn, layer.mlp
            layers.append({"input_norm": layer.input_layernorm.weight.contiguous(),
                           "post_norm": layer.post_attention_layernorm.weight.contiguous(),
                           **{name: (blocks[lin], None if lin.bias is None else lin.bias.contiguous()) for name, lin in (
                               ("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj),
                               ("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj))},
                           "k_cache": k_cache, "v_cache": v_cache})
        return kernels.DecodeLayers(layers, eps.pop(), {"C": c.hidden_size, "H": c.num_heads, "H_kv": c.num_kv_heads,
                                                        "D": c.head_dim, "I": c.intermediate_size})

    # -- a step -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self._decode_layers is not None:
            n = input_ids.shape[0]
            rows = meta if meta.num_decodes == n and meta.context_lens.shape[0] == n else self._as_decode_rows(meta, n)
            if rows is not None:
                self.last_route = "whole_step"
                return self._whole_step(input_ids, positions, rows)
        return self._forward(input_ids, positions, self.kv_cache, meta)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                 meta: AttentionMetadata) -> torch.Tensor:
        if self.plan.table:
            self.last_route = "layers"
            return self.model(input_ids, positions, kv_cache, meta, ops=self.plan.ops)
        self.last_route = "model"
        return self.model(input_ids, positions, kv_cache, meta, self.backend)

    def _whole_step(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: AttentionMetadata) -> torch.Tensor:
        """Every layer in one C call (the table's kernels on the same rows, so its bits), then the
        table's final norm."""
        from .cpu import kernels

        model = self.model
        x = model.embed_tokens(input_ids).contiguous()
        cos, sin = model.rope_cos[positions], model.rope_sin[positions]
        x = kernels.decode_layers(self._decode_layers, x, cos, sin, rows, model.layers[0].self_attn.scale)
        return self.plan.ops.rmsnorm(model.norm, x)

    def _as_decode_rows(self, meta: AttentionMetadata, n: int) -> AttentionMetadata | None:
        """A step whose every new token may attend as its own decode query (the attention's one
        rule, cpu.attention.tokens_as_decodes: e.g. a speculative step's k + 1 tokens a sequence),
        as ``n`` decode rows: token ``i`` of a sequence gets its table row and the causal context
        ``ctx - q_len + i + 1``. The rows attend with the same kernel the table's attention gives
        them, so the same bits. None where the step does not qualify."""
        if not self.plan.rows_as_decodes:
            return None
        from .cpu.attention import decode_rows, tokens_as_decodes

        qsl = meta.query_start_loc.tolist()
        ctx = meta.context_lens.tolist()
        q_lens = [qsl[s + 1] - qsl[s] for s in range(len(ctx))]
        if sum(q_lens) != n or any(q < 1 or q > c for q, c in zip(q_lens, ctx)) or not tokens_as_decodes(q_lens, ctx):
            return None
        tables, lens = decode_rows(meta.block_tables, range(len(ctx)), q_lens, ctx)
        return AttentionMetadata(slot_mapping=meta.slot_mapping, block_tables=tables, context_lens=lens,
                                 query_start_loc=torch.arange(n + 1, dtype=torch.int32), num_decodes=n)

    def copy_blocks(self, pairs: list) -> None:
        """Copy-on-write: each (source, destination) block's K/V in every layer, before the step writes."""
        from .prefix_cache import copy_blocks

        copy_blocks(self.kv_cache, pairs)

    def weight_bytes_read(self) -> int | None:
        """Bytes of weights one token at batch 1 reads where every linear layer multiplies from
        GGUF blocks (their integers and scales); None where the fp32 weights are read."""
        blocks = self.plan.blocks
        if not blocks or len(blocks) != len(self.model.linears()):
            return None
        return sum(b.stream_bytes for b in {id(b): b for b in blocks.values()}.values())

    # -- the next token ---------------------------------------------------------------------
    @torch.no_grad()
    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's argmax of the logits, straight from the head's GGUF blocks (9+ rows; the same
        products, so the same tokens), where the plan allows; None: compute the logits."""
        if not self.plan.head_argmax or hidden.shape[0] <= 8:
            return None
        from .cpu import kernels

        return kernels.qmatmul_argmax(hidden.contiguous(), self.plan.blocks[self.model.lm_head])

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.plan.table:
            return self.model.compute_logits(hidden, ops=self.plan.ops)
        return self.model.compute_logits(hidden)

    @torch.no_grad()
    def prompt_logits(self, token_ids: list[int], block_size: int) -> torch.Tensor:
        """(P, vocab) float32: every prompt position's logits, from one more pass of the prompt on
        the plan's table into a scratch cache of its own (the plan's ``prompt_logprobs`` route)."""
        device = next(self.model.parameters()).device
        ids, positions, cache, meta = scratch_pass(self.model, token_ids, block_size, device)
        cache = _like_engine_pages(cache, self.kv_cache)
        route = self.last_route  # the engine's step routes are not this pass's
        hidden = self._forward(ids, positions, cache, meta)
        self.last_route = route
        return self.compute_logits(hidden)


def _like_engine_pages(scratch: KVCache, engine_cache: Any) -> KVCache:
    """The scratch cache in the engine's page format (kv_cache_dtype), fp8 layers at the engine's
    scales, so a prompt's logprobs read K/V as its steps do."""
    name = getattr(engine_cache, "kv_cache_dtype", "auto")
    if name == "auto":
        return scratch
    from .kv_quant import set_layer_scale

    out = KVCache(scratch.num_layers, scratch.num_blocks, scratch.block_size, scratch.num_kv_heads, scratch.head_dim,
                  scratch.dtype, scratch.k[0].device, kv_cache_dtype=name)
    if not out.format.per_block:
        for mine, theirs in zip(out.k + out.v, engine_cache.k + engine_cache.v):
            set_layer_scale(mine, float(theirs.kv_layer_scale))
            mine.kv_calibrate = theirs.kv_calibrate
    return out


def make_executor(config: Any, model: nn.Module, device: torch.device, attention: Any, kv_cache: KVCache) -> Executor:
    """The plan for this engine, and the executor that carries it out."""
    return Executor(build_plan(config, model, device, attention), model, kv_cache)


__all__ = ["Executor", "make_executor", "scratch_pass"]

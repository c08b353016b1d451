"""The table of kernels one forward pass calls: the contract between model/llama.py and its speed.

Owns the seven ops every stage of ``LlamaModel.forward`` goes through, their signatures, and how a
table names what runs (``Ops.routes``). It holds no kernel: llama.py defines the plain table
(``plain_ops``, PyTorch on the model's own modules), and the engine's plan (minipaged/plan.py)
builds faster ones from the same contract, once per engine. Any table gives the same maths; a fast
one is tested bit for bit against it.

Shapes: N new tokens, C hidden size, I intermediate size, H heads, H_kv KV heads, D head_dim.

==============  ==================================================  =========================================
op              signature                                           returns
==============  ==================================================  =========================================
``linear``      (module: nn.Linear, x (N, in))                      x @ module.weight^T + bias, (N, out)
``rmsnorm``     (norm: RMSNorm, x (N, C))                           norm(x), (N, C)
``add_rmsnorm`` (norm: RMSNorm, x (N, C), y (N, C))                 (norm(x + y), x + y): the residual add,
                                                                    then its norm; x itself is not changed
``rope``        (q (N, H, D), k (N, H_kv, D), cos (N, D), sin)      (q, k) rotated (may rotate in place)
``silu_mul``    (gate (N, I), up (N, I))                            SiLU(gate) * up (may write into gate)
``write_kv``    (k_cache, v_cache, k (N, H_kv, D), v, slots (N,))   None: each token's K, V into its slot
``attention``   (q (N, H, D), k_cache, v_cache, attn, scale)        (N, H, D): each new token over its context
==============  ==================================================  =========================================

``attn`` is the step's ``AttentionMetadata``; ``k_cache``/``v_cache`` one layer's pages
(num_blocks, block_size, H_kv, D).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping

OP_NAMES = ("linear", "rmsnorm", "add_rmsnorm", "rope", "silu_mul", "write_kv", "attention")


@dataclass(frozen=True)
class Op:
    """One entry of a table: ``fn`` computes it (the signature of its row above); ``routes`` is what
    the plan prints for it, stage -> implementation (e.g. ``{"linear": "torch (F.linear)"}``)."""

    fn: Callable[..., Any]
    routes: Mapping[str, str]

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


@dataclass(frozen=True)
class Ops:
    """A complete table: one :class:`Op` per stage of the forward (see the module docstring)."""

    linear: Op
    rmsnorm: Op
    add_rmsnorm: Op
    rope: Op
    silu_mul: Op
    write_kv: Op
    attention: Op

    def routes(self) -> dict[str, str]:
        """Stage -> what runs it, read from the ops themselves (ops naming one stage differently are
        joined with "; ")."""
        out: dict[str, str] = {}
        for f in fields(self):
            for stage, route in getattr(self, f.name).routes.items():
                if stage in out and route not in out[stage].split("; "):
                    out[stage] = f"{out[stage]}; {route}"
                else:
                    out.setdefault(stage, route)
        return out

    def relabel(self, **lines: str) -> "Ops":
        """The same ops, each stage named in ``lines`` printed as given (where the table runs on a
        setting its ops cannot see, e.g. one tensor-parallel rank's shard)."""
        def fix(op: Op) -> Op:
            return replace(op, routes={s: lines.get(s, r) for s, r in op.routes.items()})

        return replace(self, **{f.name: fix(getattr(self, f.name)) for f in fields(self)})


__all__ = ["OP_NAMES", "Op", "Ops"]

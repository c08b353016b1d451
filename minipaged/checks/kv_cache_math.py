"""Checks for workbook 01: KV-cache arithmetic (bytes per token and per sequence, how many
sequences fit a budget, contiguous vs paged) against the formulas of minipaged.kv_cache.

Each function is tried on real model shapes (2, 4 and 1 bytes a number) and on seeded random
ones, with sequence lengths one short of, right at and one past block boundaries and at the
model's max_model_len; a wrong number is explained by which factor it is off by.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from ._core import DEFAULT_TIMEOUT_S, builds, failure, learner_call, length_situations, passed, plural
from ._delegation import run_guarded

NAME = "01 KV-cache math"


def _refuse(*named: tuple) -> None:
    from ._delegation import refuse_package_function

    for fn, what in named:
        refuse_package_function(fn, NAME, what)


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache of a model depends on (nothing else about the model matters)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int  # 2 for bf16/fp16, 4 for fp32
    max_model_len: int = 8192


SMOLLM2_135M = ModelShape("SmolLM2-135M-Instruct (bf16)", num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2)
LLAMA3_8B = ModelShape("Llama-3-8B (bf16)", num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
TINY_FP32 = ModelShape("a tiny fp32 test model", num_layers=2, num_kv_heads=1, head_dim=8, dtype_bytes=4, max_model_len=64)
MODELS = [SMOLLM2_135M, LLAMA3_8B, TINY_FP32]
# One byte a number (workbook 04's int8 KV cache): with it the checks try every element size, 4, 2 and 1 bytes.
SMOLLM2_INT8 = ModelShape("SmolLM2-135M-Instruct (int8 KV cache)", num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=1)


# -- the reference formulas ---------------------------------------------------------------------
def ref_bytes_per_token(m) -> int:
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes  # K and V, every layer


def ref_bytes_per_sequence(m, num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size) * block_size * ref_bytes_per_token(m)


def ref_max_seqs_contiguous(m, budget_bytes: int, max_model_len: int) -> int:
    return budget_bytes // (max_model_len * ref_bytes_per_token(m))


def ref_max_seqs_paged(m, budget_bytes: int, num_tokens: int, block_size: int) -> int:
    num_blocks = budget_bytes // (block_size * ref_bytes_per_token(m))
    return num_blocks // -(-num_tokens // block_size)


def _shapes(seed: int, n: int) -> list[ModelShape]:
    rng = random.Random(seed)
    out = MODELS + [SMOLLM2_INT8]
    for i in range(n):
        out.append(ModelShape(f"random model {i + 1}", rng.randint(1, 48), rng.choice([1, 2, 4, 8]),
                              rng.choice([32, 64, 80, 128]), rng.choice([2, 4]), rng.choice([2048, 4096, 8192])))
    return out



def _m(m: ModelShape) -> str:
    return (f"{m.name}: num_layers={m.num_layers}, num_kv_heads={m.num_kv_heads}, head_dim={m.head_dim}, "
            f"dtype_bytes={m.dtype_bytes}")


def _int_result(title: str, got, exp: int, desc: str, hint_float: str) -> None:
    if isinstance(got, float):
        raise failure(title, done=desc, expected=f"the int {exp}", got=f"the float {got!r}",
                      hint=(hint_float + " Use // (floor division) so the answer stays an int.").strip())
    if isinstance(got, bool) or not isinstance(got, int):
        try:
            import numpy as np  # noqa: F401
            import torch

            if isinstance(got, torch.Tensor) and got.numel() == 1:
                raise failure(title, done=desc, expected=f"the int {exp}", got=f"a tensor {got!r}",
                              hint="return a plain Python int (int(x)), not a tensor.")
        except ImportError:  # pragma: no cover
            pass
        raise failure(title, done=desc, expected=f"the int {exp}", got=f"{got!r} ({type(got).__name__})",
                      hint="return a number: an int of bytes or of sequences.")


# Every factor of bytes_per_token differs here (2 for K and V, 3 layers, 5 KV heads, head_dim 7,
# 4 bytes): on SmolLM2 a missing dtype_bytes (2) looks exactly like a missing K-and-V factor (2).
PROBE = ModelShape("a probe shape whose factors all differ", num_layers=3, num_kv_heads=5, head_dim=7, dtype_bytes=4)


def _factors(m: ModelShape) -> list[tuple[str, float, str]]:
    return [("kv", 2, "K and V are two tensors: each token stores a key AND a value vector (the factor 2)"),
            ("layers", m.num_layers, "every layer keeps its own K and V: multiply by num_layers"),
            ("dtype", m.dtype_bytes, "multiply by dtype_bytes: the count is in bytes, not in numbers"),
            ("heads", m.num_kv_heads, "multiply by num_kv_heads (the KV heads, not the query heads: GQA shares them)"),
            ("head_dim", m.head_dim, "each head stores head_dim numbers per token"),
            ("bits", 1 / 8, "bytes, not bits: dtype_bytes is already bytes per number")]


def _matching(got, exp: int, m: ModelShape) -> list[tuple[str, float, str]]:
    """The factors that ``got`` is exactly off by (several when the shape has equal factors)."""
    if isinstance(got, bool) or not isinstance(got, (int, float)) or got == 0:
        return []
    r = exp / got
    return [f for f in _factors(m) if f[1] != 1 and abs(r - f[1]) < 1e-9]


def _factor_hint(got, exp: int, m: ModelShape, probe: Callable | None = None) -> str:
    """Which factor ``got`` misses. When ``m`` has equal factors (SmolLM2: K-and-V 2 = dtype_bytes 2),
    ``probe(PROBE)`` (the learner's function) on a shape whose factors all differ says which one."""
    general = "bytes per token = 2 (K and V) * num_layers * num_kv_heads * head_dim * dtype_bytes."
    found = _matching(got, exp, m)
    if not found:
        return general
    factor = found[0][1]
    size = f"1/{int(factor)} of" if factor >= 1 else f"{int(round(1 / factor))} times"
    if len(found) > 1 and probe is not None:
        try:
            on_probe = _matching(probe(PROBE), ref_bytes_per_token(PROBE), PROBE)
        except Exception:  # noqa: BLE001 - the probe only sharpens the hint
            on_probe = []
        keys = {k for k, _, _ in on_probe}
        narrowed = [f for f in found if f[0] in keys]
        if narrowed:
            found = narrowed
    if len(found) == 1:
        return f"yours is exactly {size} the answer: {found[0][2]}."
    return (f"yours is exactly {size} the answer, which more than one missing factor explains here: "
            + "; or ".join(f[2] for f in found) + ". " + general)


def _factors_differ(m: ModelShape) -> bool:
    """True when no factor of bytes_per_token is 1 or equals another, so a missing one shows alone."""
    factors = [2, m.num_layers, m.num_kv_heads, m.head_dim, m.dtype_bytes]
    return 1 not in factors and len(set(factors)) == len(factors)


def check_bytes_per_token(bytes_per_token: Callable, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    _refuse((bytes_per_token, "bytes_per_token"))
    shapes = _shapes(0, 10) + [PROBE]  # PROBE last: the real shapes' messages come first

    def body():
        sizes = set()
        for m in shapes:
            if _factors_differ(m):
                builds("distinct factors")
            sizes.add(m.dtype_bytes)
            if sizes >= {1, 2, 4}:
                builds("each dtype")
            exp = ref_bytes_per_token(m)
            got = learner_call(bytes_per_token, m, what=f"bytes_per_token({m.name})")
            title = f"{NAME}: bytes_per_token is wrong for {m.name}."
            _int_result(title, got, exp, _m(m), "")
            if got != exp and m.dtype_bytes != 2 and got == exp // m.dtype_bytes * 2:
                raise failure(title, done=_m(m), expected=f"{exp:,} bytes per token", got=f"{got!r}",
                              hint=f"yours is the answer for 2 bytes a number, but this shape has dtype_bytes="
                                   f"{m.dtype_bytes}: multiply by m.dtype_bytes, never assume 2.")
            if got != exp:
                raise failure(title, done=_m(m), expected=f"{exp:,} bytes per token", got=f"{got!r}",
                              hint=_factor_hint(got, exp, m, probe=bytes_per_token))

    run_guarded("01", NAME, body, timeout, {"current": "bytes_per_token(...)"})
    b = ref_bytes_per_token(SMOLLM2_135M)
    passed(f"bytes_per_token: right for {len(shapes)} model shapes (2, 4 and 1 bytes a number). SmolLM2-135M keeps {b:,} bytes "
           f"({b / 1024:.1f} KiB) of KV per token; Llama-3-8B {ref_bytes_per_token(LLAMA3_8B) // 1024} KiB.")


def check_bytes_per_sequence(bytes_per_sequence: Callable, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    _refuse((bytes_per_sequence, "bytes_per_sequence"))
    def body():
        rng = random.Random(1)
        for m in _shapes(1, 6):
            for bs in (1, 16, rng.choice([4, 8, 32])):
                # One short of, at and one past the block boundaries, and the model's whole context.
                for n in sorted({1, bs - 1, bs, bs + 1, 2 * bs, rng.randint(1, 600), m.max_model_len} - {0}):
                    builds(*length_situations(n, bs, m.max_model_len))
                    exp = ref_bytes_per_sequence(m, n, bs)
                    what = f"bytes_per_sequence({m.name}, num_tokens={n}, block_size={bs})"
                    got = learner_call(bytes_per_sequence, m, n, bs, what=what)
                    title = f"{NAME}: {what} is wrong."
                    desc = _m(m) + f"\nbytes_per_token = {ref_bytes_per_token(m):,}"
                    _int_result(title, got, exp, desc, "")
                    if got == exp:
                        continue
                    bpt = ref_bytes_per_token(m)
                    blocks = -(-n // bs)
                    if got == n * bpt:
                        h = (f"paged memory is handed out in whole blocks: {plural(n, 'token')} take ceil({n} / {bs}) = "
                             f"{plural(blocks, 'block')} of {bs} slots, {blocks * bs} slots in all, even if the last is partly empty.")
                    elif got == (n // bs + 1) * bs * bpt:
                        h = (f"off by one block at the boundary: {plural(n, 'token')} in blocks of {bs} need {blocks}, not {n // bs + 1}. "
                             "Round up with -(-n // block_size), or (n + block_size - 1) // block_size.")
                    elif isinstance(got, int) and 0 < got < exp and got % bpt == 0 and n > 1024:
                        h = (f"yours prices {got // bpt:,} token slots of the {n:,}: something caps the length (a window, "
                             f"a table of fixed size). A sequence can be as long as the model's max_model_len "
                             f"({m.max_model_len:,} here).")
                    else:
                        h = "bytes per sequence = ceil(num_tokens / block_size) * block_size * bytes_per_token."
                    raise failure(title, done=desc, expected=f"{exp:,} bytes ({plural(blocks, 'block')} of {bs} slots)",
                                  got=f"{got!r}", hint=h)

    run_guarded("01", NAME, body, timeout, {"current": "bytes_per_sequence(...)"})
    passed("bytes_per_sequence: right for every model, block size and length tried (1 token, one short of a full block, "
           "a full block, one past it, the model's max_model_len).")


def check_max_seqs(max_seqs_contiguous: Callable, max_seqs_paged: Callable, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    _refuse((max_seqs_contiguous, "max_seqs_contiguous"), (max_seqs_paged, "max_seqs_paged"))
    def body():
        rng = random.Random(2)
        for m in _shapes(2, 6):
            bpt = ref_bytes_per_token(m)
            budgets = [bpt * m.max_model_len * 3, bpt * m.max_model_len * 3 - 1, bpt * 16 * 5, 8 * 2**30,
                       rng.randint(1, 40) * 2**30, bpt * 7]
            for budget in budgets:
                builds("max_model_len")  # the contiguous cache reserves the model's whole context for each sequence
                if budget % (m.max_model_len * bpt):
                    builds("budget remainder")
                exp = ref_max_seqs_contiguous(m, budget, m.max_model_len)
                what = f"max_seqs_contiguous({m.name}, budget_bytes={budget:_}, max_model_len={m.max_model_len})"
                got = learner_call(max_seqs_contiguous, m, budget, m.max_model_len, what=what)
                title = f"{NAME}: {what} is wrong."
                _int_result(title, got, exp, _m(m), "a fraction of a sequence does not fit.")
                if got != exp:
                    raise failure(title, done=_m(m), expected=f"{exp} sequences", got=f"{got!r}",
                                  hint=("a contiguous cache reserves max_model_len slots for every sequence up front, "
                                        "whatever its real length: budget // (max_model_len * bytes_per_token)."))
                for bs in (16, rng.choice([1, 8, 32])):
                    for n in sorted({1, bs - 1, bs, bs + 1, rng.randint(1, m.max_model_len), m.max_model_len} - {0}):
                        builds(*length_situations(n, bs, m.max_model_len))
                        if budget % (-(-n // bs) * bs * bpt):
                            builds("budget remainder")
                        exp = ref_max_seqs_paged(m, budget, n, bs)
                        what = f"max_seqs_paged({m.name}, budget_bytes={budget:_}, num_tokens={n}, block_size={bs})"
                        got = learner_call(max_seqs_paged, m, budget, n, bs, what=what)
                        title = f"{NAME}: {what} is wrong."
                        _int_result(title, got, exp, _m(m), "a fraction of a sequence does not fit.")
                        if got == exp:
                            continue
                        blocks = -(-n // bs)
                        pool = budget // (bs * bpt)
                        if got == budget // (n * bpt):
                            h = (f"each sequence takes whole blocks: {plural(n, 'token')} need {plural(blocks, 'block')} of {bs}. Count the "
                                 f"blocks in the budget ({pool}), then divide by the blocks per sequence.")
                        elif got == budget // (m.max_model_len * bpt):
                            h = "that is the contiguous answer: paged memory reserves only the blocks a sequence really uses."
                        else:
                            h = (f"blocks in the budget = budget // (block_size * bytes_per_token) = {pool}; blocks per "
                                 f"sequence = ceil({n} / {bs}) = {blocks}; sequences = {pool} // {blocks}.")
                        raise failure(title, done=_m(m), expected=f"{exp} sequences", got=f"{got!r}", hint=h)

    run_guarded("01", NAME, body, timeout, {"current": "max_seqs_...(...)"})
    m, budget = SMOLLM2_135M, 2 * 2**30
    c = ref_max_seqs_contiguous(m, budget, m.max_model_len)
    p = ref_max_seqs_paged(m, budget, 300, 16)
    passed(f"max_seqs_contiguous and max_seqs_paged: right everywhere. In 2 GiB, SmolLM2 fits {c} sequences reserved for "
           f"{m.max_model_len} tokens each, but {p:,} paged sequences of 300 tokens.")


def check(bytes_per_token, bytes_per_sequence, max_seqs_contiguous, max_seqs_paged, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    check_bytes_per_token(bytes_per_token, timeout=timeout)
    check_bytes_per_sequence(bytes_per_sequence, timeout=timeout)
    check_max_seqs(max_seqs_contiguous, max_seqs_paged, timeout=timeout)


__all__ = ["ModelShape", "SMOLLM2_135M", "LLAMA3_8B", "MODELS", "check", "check_bytes_per_token",
           "check_bytes_per_sequence", "check_max_seqs"]

"""Checks for workbook 04's second part: 8-bit KV pages, one scale per (block, KV head).

The learner writes the int8 page code minipaged's ``kv_cache_dtype="int8"`` runs on
(minipaged.kv_quant): the scales of a block, quantize and dequantize, copy-on-write of a block
with its scales, a gather that dequantizes, and paged attention over int8 pages. Each check runs
the learner's function and minipaged's own int8 page code side by side on the same blocks and
stops at the first difference; a hint names the rule broken (round to nearest, clip to +-127,
no division by an all-zero head's scale of 0, the scales copied with the block, the scales read).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from .. import kv_quant
from ..attention.reference import gather_kv as ref_gather_kv
from ..attention.reference import paged_attention as ref_paged_attention
from ._core import DEFAULT_TIMEOUT_S, SITUATIONS, builds, failure, fmt_list, learner_call, passed
from ._delegation import refuse_package_function, run_guarded
from .paged_attention import MAX_MODEL_LEN, Case, attention_cases, compare_case, make_case, reused_cases, situations_of

NAME = "04 int8 KV pages"
INT8 = kv_quant.FORMATS["int8"]
QMAX = int(INT8.qmax)  # 127
SITUATIONS.update({
    "own scale per block": "blocks of their own magnitudes (each block and KV head, in the quantize cases), so one "
                           "scale shared by all, or another block's, shows",
})
# Added to a hint where a case hands in again the tensors of a call before, changed in place since.
_AGAIN = (" (These are the tensors of a call before, changed in place and handed in again: work from what they hold "
          "now, and keep nothing between calls keyed on id() or data_ptr().)")


# -- minipaged's own int8 pages, the reference ------------------------------------------------------------

def _kind(t: object) -> str:
    """What a learner's function returned, in a failure's words: a tensor's dtype and shape, else its type."""
    return f"{t.dtype}, shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__

def ref_pages(x: torch.Tensor) -> torch.Tensor:
    """Blocks ``x`` (n, block_size, H, D) written whole into minipaged's int8 pages: the pages, with their
    (n, H) scales as ``.kv_scales`` (minipaged.kv_quant.write, as the engine writes a block)."""
    n, bs, h, d = x.shape
    cache = kv_quant.new_cache((n, bs, h, d), INT8)
    kv_quant.write(cache, x.reshape(n * bs, h, d), torch.arange(n * bs))
    return cache


def _plain(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the int8 values, the (n, H) scales) as plain tensors, without minipaged's attributes."""
    return cache.clone(), kv_quant.kv_scales(cache).clone()


class _NaNWatch(TorchFunctionMode):
    """Records the first torch operation, run by the learner's code, that makes a NaN from inputs without one."""

    def __init__(self) -> None:
        super().__init__()
        self.made: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.made is None and isinstance(out, torch.Tensor) and out.is_floating_point() and bool(out.isnan().any()):
            ins = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            if not any(a.is_floating_point() and bool(a.isnan().any()) for a in ins):
                self.made = getattr(func, "__name__", str(func))
        return out


# -- the reference with one mistake switched on (for hints only) ------------------------------------------
def variant_quantize(x: torch.Tensor, scales: torch.Tensor, mistake: str) -> torch.Tensor:
    s = scales[:, None, :, None]
    y = torch.where(s > 0, x.float() / torch.where(s > 0, s, 1.0), 0.0)
    if mistake == "truncate":
        return y.trunc().clamp(-QMAX, QMAX).to(torch.int8)
    if mistake == "wrap":  # no clip: int8's conversion wraps around (300 -> 44)
        return y.round().to(torch.int32).to(torch.int8)
    if mistake == "clip128":
        return y.round().clamp(-128, 127).to(torch.int8)
    raise ValueError(mistake)


def _quantize_hint(x: torch.Tensor, scales: torch.Tensor, got: torch.Tensor) -> str:
    if torch.equal(got, variant_quantize(x, scales, "truncate")):
        return ("your values match x / scale TRUNCATED toward zero (what .to(torch.int8) does to 2.7: 2). Round to the "
                "nearest first, with torch.round: 2.7 is 3 and -2.7 is -3; truncation makes every value smaller and the "
                "error twice as large.")
    if torch.equal(got, variant_quantize(x, scales, "wrap")):
        return ("values beyond int8's range wrapped around (x / scale = 300 stored as 44): .to(torch.int8) does not clip. "
                f"Clip to the format's range first: .clamp(-{QMAX}, {QMAX}), then convert.")
    if torch.equal(got, variant_quantize(x, scales, "clip128")):
        return (f"you clipped to -128 .. 127: the format is symmetric, -{QMAX} .. {QMAX}, so that -q means -x and one "
                "scale serves both signs.")
    return ("q = round(x / scale), clipped to -127 .. 127, as int8; the scale of (block b, KV head h) divides every value "
            "of that block's head h: scales[b, h] against x[b, :, h, :].")


def _blocks(seed: int, n: int = 3, bs: int = 4, h: int = 2, d: int = 8, size: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, bs, h, d, generator=g) * size
    # a different magnitude per (block, head): a scale per (block, head) is what keeps the small ones precise
    return x * torch.logspace(-1, 1, n * h).reshape(n, 1, h, 1)


# -- the checks -------------------------------------------------------------------------------------------
def check_quantize(block_scales: Callable, quantize: Callable, dequantize: Callable,
                   timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``block_scales(x)`` -> (n, H); ``quantize(x, scales)`` -> int8 like x; ``dequantize(q, scales)`` -> fp32."""
    refuse_package_function(block_scales, NAME, "block_scales")
    refuse_package_function(quantize, NAME, "quantize")
    refuse_package_function(dequantize, NAME, "dequantize")
    zero = _blocks(41)
    zero[1] = 0.0  # a whole block of zeros
    zero[2, :, 0] = 0.0  # and one KV head of another block
    # (what, the blocks, given scales or None, its situations beyond "own scale per block"); the last case hands in
    # the first case's tensors again, new blocks written into them in place
    cases = [("3 blocks of 4 slots, 2 KV heads, head_dim 8; each (block, head) of its own magnitude", _blocks(40), None,
              ()),
             ("block size 16, 4 KV heads, head_dim 16", _blocks(42, n=2, bs=16, h=4, d=16), None, ()),
             ("block 1 all zeros, and KV head 0 of block 2 (nothing written there yet)", zero, None,
              ("numerical edge",)),
             ("given scales of 0.05 (a layer's fixed scale, as fp8's): values up to about 600 times the scale",
              _blocks(43, size=3.0), torch.full((3, 2), 0.05), ("numerical edge",)),
             ("the first case's tensors x, scales and q, handed in again with new blocks written into them in place",
              _blocks(44), None, ("reused object",))]
    held: dict = {}  # the first case's tensors, as handed to each function
    state = {"current": "block_scales(x)"}

    def hand(key: str, t: torch.Tensor, again: bool) -> torch.Tensor:
        """``t`` for the learner: a copy, or (``again``) written into the first case's tensor ``key``."""
        if again:
            return held[key].copy_(t)
        mine = t.clone()
        held.setdefault(key, mine)
        return mine

    def _body():
        builds("package code in place")
        for what_case, x, given, situations in cases:
            again = "reused object" in situations
            builds(*situations)
            note = _AGAIN if again else ""
            ref = ref_pages(x)
            exp_q, exp_s = _plain(ref)
            desc = f"x of shape {tuple(x.shape)} (num_blocks, block_size, num_kv_heads, head_dim): {what_case}"
            if given is None:
                builds("own scale per block")
                state["current"] = what = "block_scales(x)"
                got_s = learner_call(block_scales, hand("block_scales x", x, again), what=what)
                if not isinstance(got_s, torch.Tensor) or tuple(got_s.shape) != tuple(exp_s.shape):
                    raise failure(f"{NAME}: {what} has the wrong shape.", done=desc,
                                  expected=f"a tensor of shape {tuple(exp_s.shape)} = (num_blocks, num_kv_heads)",
                                  got=str(tuple(got_s.shape)) if isinstance(got_s, torch.Tensor) else type(got_s).__name__,
                                  hint="one scale per (block, KV head): the largest |x| over that block's slots and head_dim, / 127.")
                if not torch.allclose(got_s.float(), exp_s, rtol=1e-5, atol=0):
                    b, h = (~torch.isclose(got_s.float(), exp_s, rtol=1e-5, atol=0)).nonzero()[0].tolist()
                    hint = (f"(block {b}, KV head {h}) holds only zeros: its scale is 0 (nothing to scale), never a made-up "
                            "1.0 or epsilon; quantize then stores zeros there without dividing by it."
                            if float(exp_s[b, h]) == 0 else
                            f"scales[b, h] = max |x[b, :, h, :]| / {QMAX}: the largest magnitude over the block's slots and "
                            f"head_dim of that one KV head, mapped to int8's largest, {QMAX}.")
                    raise failure(f"{NAME}: {what}: the scale of block {b}, KV head {h} differs.", done=desc,
                                  expected=f"{float(exp_s[b, h]):.6g}", got=f"{float(got_s[b, h]):.6g}",
                                  hint=hint + note)
                scales = exp_s
            else:
                scales = given.clone()
                exp_q = kv_quant.quantize(x, scales[:, None, :, None], INT8)
            what = "quantize(x, scales)"
            state["current"] = what
            watch = _NaNWatch()
            with watch:
                got_q = learner_call(quantize, hand("quantize x", x, again),
                                     hand("quantize scales", scales, again), what=what)
            if watch.made is not None:
                raise failure(f"{NAME}: {what} made a NaN (torch.{watch.made}) on case \"{what_case}\".", done=desc,
                              expected="no NaN at any step: an all-zero (block, head) has scale 0, and its values are stored as 0",
                              got=f"NaN from {watch.made}, from inputs without one",
                              hint="you divided by a scale of 0: 0 / 0 is NaN (that it became 0 in int8 here is luck: "
                                   "converting NaN to an integer is undefined, and a NaN left in a float page poisons every "
                                   "read of its block). Divide only where scale > 0, e.g. x / torch.where(s > 0, s, 1), "
                                   "and store 0 where the scale is 0.")
            if not isinstance(got_q, torch.Tensor) or got_q.dtype != torch.int8 or tuple(got_q.shape) != tuple(x.shape):
                got = (f"{got_q.dtype}, shape {tuple(got_q.shape)}" if isinstance(got_q, torch.Tensor)
                       else type(got_q).__name__)
                raise failure(f"{NAME}: {what} returned the wrong kind of tensor.", done=desc,
                              expected=f"torch.int8, shape {tuple(x.shape)} (like x)", got=got,
                              hint="round, clip, then .to(torch.int8): the page stores one byte per value.")
            if not torch.equal(got_q, exp_q):
                bad = (got_q != exp_q).nonzero()[0].tolist()
                raise failure(f"{NAME}: {what} differs from minipaged's int8 pages at q{bad}.", done=desc,
                              expected=f"{int(exp_q[tuple(bad)])} (x = {float(x[tuple(bad)]):.5g}, scale "
                                       f"{float(scales[bad[0], bad[2]]):.5g})",
                              got=f"{int(got_q[tuple(bad)])}; {int((got_q != exp_q).sum())} of {exp_q.numel()} values differ",
                              hint=_quantize_hint(x, scales, got_q) + note)
            what = "dequantize(q, scales)"
            state["current"] = what
            exp_x = kv_quant.read_blocks(ref, torch.arange(x.shape[0])) if given is None else \
                kv_quant.dequantize(exp_q, scales[:, None, :, None])
            got_x = learner_call(dequantize, hand("dequantize q", exp_q, again),
                                 hand("dequantize scales", scales, again), what=what)
            if not isinstance(got_x, torch.Tensor) or got_x.dtype != torch.float32 or tuple(got_x.shape) != tuple(x.shape) \
                    or not torch.allclose(got_x, exp_x, rtol=1e-6, atol=0):
                raise failure(f"{NAME}: {what} differs from minipaged's read of the same pages.", done=desc,
                              expected=f"float32 of shape {tuple(x.shape)}: q * scales[b, h]",
                              got=_kind(got_x),
                              hint="a stored value q of block b, KV head h means q * scales[b, h]: "
                                   "q.float() * scales[:, None, :, None]." + note)

    run_guarded("04", NAME, _body, timeout, state)
    passed(f"int8 quantize: {len(cases)} sets of blocks (own magnitude per (block, head), block size 16, all-zero blocks "
           "and heads, values beyond the range of a given scale, tensors changed in place and handed in again) matched "
           "minipaged's int8 pages.")


def check_copy_block(copy_block: Callable, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``copy_block(cache, scales, src, dst)``: block ``src`` copied to ``dst`` in place, with its scales."""
    refuse_package_function(copy_block, NAME, "copy_block")
    state = {"current": "copy_block(...)"}
    x = _blocks(50, n=5)
    x[3] *= 20  # block 3 (the stale copy's target) had much larger values: its old scale is far from block 1's
    ref = ref_pages(x)
    moves = [(1, 3), (0, 4), (2, 2)]

    def _body():
        builds("package code in place", "own scale per block")
        cache, scales = _plain(ref)
        for i, (src, dst) in enumerate(moves):
            if i:  # the same pages and scales as the copy before, changed in place by it
                builds("reused object")
            what = f"copy_block(cache, scales, src={src}, dst={dst})"
            state["current"] = what
            before_s = scales.clone()
            learner_call(copy_block, cache, scales, src, dst, what=what)
            kv_quant.copy_blocks(ref, torch.tensor([src]), torch.tensor([dst]))
            exp_c, exp_s = _plain(ref)
            done = (f"pages of shape {tuple(cache.shape)} with their scales {tuple(scales.shape)} (num_blocks, num_kv_heads); "
                    f"block {src} and block {dst} had scales {fmt_list(f'{v:.3g}' for v in before_s[src].tolist())} and "
                    f"{fmt_list(f'{v:.3g}' for v in before_s[dst].tolist())}")
            if not torch.equal(cache, exp_c):
                raise failure(f"{NAME}: after {what} the pages differ.", done=done,
                              expected=f"block {dst} = block {src}'s int8 values, every other block unchanged",
                              got=f"blocks {fmt_list(sorted({int(b) for b in (cache != exp_c).nonzero()[:, 0]}))} differ",
                              hint="copy the whole block, in place: cache[dst] = cache[src].")
            if not torch.equal(scales, exp_s):
                stale = torch.equal(scales[dst], before_s[dst]) and not torch.equal(before_s[dst], before_s[src])
                hint = (f"the values were copied but block {dst}'s scales are still its old ones: a copy-on-write copies "
                        "the block's scales with it (scales[dst] = scales[src]), or the copied int8 values are read with "
                        "the wrong scale and the shared prefix comes back scaled wrong." if stale else
                        "scales[dst] = scales[src], in place; the other blocks' scales stay as they are.")
                raise failure(f"{NAME}: after {what} the scales differ.", done=done,
                              expected=f"scales[{dst}] = {fmt_list(f'{v:.4g}' for v in exp_s[dst].tolist())}",
                              got=f"scales[{dst}] = {fmt_list(f'{v:.4g}' for v in scales[dst].tolist())}", hint=hint)

    run_guarded("04", NAME, _body, timeout, state)
    passed(f"copy-on-write of int8 blocks: {len(moves)} copies (a block over one with another scale, a block onto itself) "
           "matched minipaged's, scales included.")


def quantized_case(case: Case) -> tuple[Case, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``case`` with its caches stored as minipaged's int8 pages: (the case over those pages, for the reference;
    (k int8, k scales, v int8, v scales) as plain tensors, for the learner)."""
    kq, vq = ref_pages(case.k_cache), ref_pages(case.v_cache)
    c = Case(**{**case.__dict__})
    ids = torch.arange(kq.shape[0])
    c.k_cache, c.v_cache = kv_quant.read_blocks(kq, ids), kv_quant.read_blocks(vq, ids)  # minipaged's dequantizing read
    return c, (*_plain(kq), *_plain(vq))


def int8_args(case: Case) -> tuple:
    """The arguments of ``paged_attention_int8`` for ``case``, its caches stored as minipaged's int8 pages."""
    _, (kq, ks, vq, vs) = quantized_case(case)
    return (case.q.clone(), kq, vq, ks, vs, case.block_tables.clone(), case.context_lens.clone(),
            case.query_start_loc.clone(), case.scale)


def case_named(name: str) -> tuple[Case, tuple]:
    """The int8 attention check's case ``name`` and its arguments, to replay it in a cell:
    ``case, args = kv_int8.case_named(name); out = paged_attention_int8(*args)``."""
    for c in _attention_cases():
        if c.name == name:
            return c, int8_args(c)
    raise KeyError(f"no case {name!r}; the cases are: {[c.name for c in _attention_cases()]}")


def _attention_cases() -> list[Case]:
    names = ("prefill of one short sequence", "decode through an out-of-order block table", "decode with GQA",
             "mixed batch", "block size 16", "random batch 2", "at SmolLM2's max_model_len")
    return [c for c in attention_cases() if c.name.startswith(names)]


def check_gather_kv_int8(gather_kv_int8: Callable, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``gather_kv_int8(cache, scales, block_table, context_len)`` -> (context_len, H, D) float32, dequantized."""
    refuse_package_function(gather_kv_int8, NAME, "gather_kv_int8")
    # (context_len, blocks in order, block_size, num_kv_heads): the next to last has more KV heads than slots in a
    # block; the last is SmolLM2's max_model_len
    cases = [(5, True, 4, 2), (11, False, 4, 2), (8, False, 4, 2), (1, False, 4, 2), (23, False, 4, 2),
             (7, False, 2, 4), (MAX_MODEL_LEN, False, 16, 2)]
    state = {"current": "gather_kv_int8(...)"}

    def paged(seed: int, ctx: int, in_order: bool = False, bs: int = 4, hkv: int = 2) -> tuple[Case, Case, tuple]:
        """(a case of one sequence whose blocks each have their own magnitude, it over minipaged's int8 pages,
        (k int8, k scales))."""
        case = make_case("gather", "", [(ctx, 1)], num_heads=hkv, num_kv_heads=hkv, head_dim=4, block_size=bs,
                         seed=seed, in_order=in_order)
        case.k_cache = case.k_cache * torch.logspace(-1, 1, case.k_cache.shape[0])[:, None, None, None]
        qc, (kq, ks, _, _) = quantized_case(case)
        return case, qc, (kq, ks)

    def gather(qc: Case, kq: torch.Tensor, ks: torch.Tensor, row: torch.Tensor, ctx: int, again: str = "",
               stale=None) -> torch.Tensor:
        """``gather_kv_int8`` on these very objects against minipaged's read of ``qc``'s pages; ``again`` says how
        they changed since the call that gave ``stale``. Returns the reference's answer."""
        bs = kq.shape[1]
        what = f"gather_kv_int8(k_cache, k_scales, block_table={fmt_list(row.tolist())}, context_len={ctx})"
        state["current"] = what
        exp = ref_gather_kv(qc.k_cache, row, ctx)
        raw = ref_gather_kv(kq, row, ctx).float()
        got = learner_call(gather_kv_int8, kq, ks, row, ctx, what=what)
        desc = f"int8 pages of shape {tuple(kq.shape)}, scales {tuple(ks.shape)}, block size {bs}" + again
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(exp.shape) or got.dtype != torch.float32:
            raise failure(f"{NAME}: {what} returned the wrong kind of tensor.", done=desc,
                          expected=f"float32 of shape {tuple(exp.shape)} = (context_len, num_kv_heads, head_dim)",
                          got=_kind(got),
                          hint="gather the sequence's blocks through the table, dequantize them (float32), keep "
                               "the first context_len tokens.")
        if not torch.allclose(got, exp, rtol=1e-6, atol=0):
            if stale is not None and torch.allclose(got, stale, rtol=1e-6, atol=0):
                hint = ("you returned what the call before gave: the pages and scales are the same objects, changed in "
                        "place since (a block freed and written again). Gather from them afresh on every call; keep "
                        "nothing between calls keyed on id() or data_ptr().")
            elif torch.allclose(got, raw):
                hint = ("you gathered the right int8 values but did not multiply them by their scales: a stored q "
                        "of block b, KV head h means q * scales[b, h]. Take the scales of the same blocks "
                        "(scales[block_table[:n]]) and dequantize what you gathered.")
            else:
                tok = int((~torch.isclose(got, exp, rtol=1e-6, atol=0)).flatten(1).any(1).nonzero()[0])
                b = int(row[tok // bs])
                hint = (f"token {tok} is slot {tok % bs} of physical block {b} (block_table[{tok // bs}]): its values "
                        f"times scales[{b}] (that block's scales, not the logical block's).")
            raise failure(f"{NAME}: {what} differs from minipaged's read of the same pages.", done=desc,
                          expected=fmt_list(f"{v:.4f}" for v in exp[0, 0].tolist()),
                          got=fmt_list(f"{v:.4f}" for v in got[0, 0].tolist()), hint=hint)
        return exp

    def _body():
        builds("package code in place")
        for i, (ctx, in_order, bs, hkv) in enumerate(cases):
            case, qc, (kq, ks) = paged(60 + i, ctx, in_order, bs, hkv)
            builds(*situations_of(case, queries=False), "own scale per block")
            gather(qc, kq.clone(), ks.clone(), case.block_tables[0].clone(), ctx)
        # The engine reads one set of pages every step, written in place between steps: the same objects with a
        # block written again (values and scales) must give the new tokens (a memo keyed on id() gives the old ones).
        case, qc, (kq, ks) = paged(67, 11)
        row = case.block_tables[0].clone()
        before = gather(qc, kq, ks, row, 11)
        blk = int(row[1])
        case.k_cache[blk] = case.k_cache[blk] * -3.0
        qc, (new_kq, new_ks, _, _) = quantized_case(case)
        kq.copy_(new_kq)
        ks.copy_(new_ks)
        builds("reused object")
        gather(qc, kq, ks, row, 11, again=f"; the same pages, scales and block_table objects as the call before, "
                                          f"block {blk} written again in place since (its values and its scales)",
               stale=before)

    run_guarded("04", NAME, _body, timeout, state)
    passed(f"int8 gather: {len(cases)} block tables (in order, shuffled, a boundary, one token, more KV heads than slots "
           f"in a block, SmolLM2's max_model_len of {MAX_MODEL_LEN}) and pages changed in place and handed in again "
           "matched minipaged's dequantizing read.")


def variant_ignores_scales(case: Case, kq: torch.Tensor, vq: torch.Tensor) -> torch.Tensor:
    """Attention over the int8 values taken as numbers, their scales ignored (for the hint only)."""
    c = Case(**{**case.__dict__})
    c.k_cache, c.v_cache = kq.float(), vq.float()
    return ref_paged_attention(*c.args())


def check_paged_attention_int8(paged_attention_int8: Callable, timeout: float = DEFAULT_TIMEOUT_S,
                               atol: float = 1e-4, rtol: float = 1e-4) -> None:
    """``paged_attention_int8(q, k_cache, v_cache, k_scales, v_scales, block_tables, context_lens,
    query_start_loc, scale)`` over int8 pages, against minipaged's reference reading the same pages."""
    refuse_package_function(paged_attention_int8, NAME, "paged_attention_int8")
    cases = _attention_cases()
    reused = reused_cases()
    state = {"current": "the first case"}
    fn_name = "paged_attention_int8"

    def run(case: Case, args: tuple, replay: str) -> None:
        """The learner's attention on ``args``, ``case``'s int8 pages, against the reference reading them."""
        builds(*situations_of(case))
        qc, _ = quantized_case(case)
        kq, vq = args[1].clone(), args[2].clone()
        what = f'{fn_name}(...) on case "{case.name}"'
        state["current"] = what
        got = learner_call(paged_attention_int8, *args, what=what,
                           context=lambda case=case: "Inputs: " + case.describe())
        if isinstance(got, torch.Tensor) and got.shape == case.q.shape:
            exp = ref_paged_attention(*qc.args())
            if not torch.allclose(got.float(), exp, atol=atol, rtol=rtol) and \
                    torch.allclose(got.float(), variant_ignores_scales(case, kq, vq), atol=atol * 10, rtol=rtol * 10):
                raise failure(f"{NAME}: case \"{case.name}\" differs from the reference reading the same int8 pages.",
                              done="Inputs: " + case.describe(),
                              hint="your output matches attention over the int8 values WITHOUT their scales: your "
                                   "attention ignores the scales. A stored q of block b, KV head h means "
                                   "q * k_scales[b, h] (v_scales for V): dequantize the gathered blocks "
                                   "(your gather_kv_int8) before q @ k^T and before the weighted sum of V.")
        compare_case(qc, got, NAME, fn_name, atol, rtol, replay=replay)

    def _body():
        builds("package code in place")
        for case in cases:
            run(case, int8_args(case), f"To replay: from minipaged.checks import kv_int8\n    case, args = "
                                       f"kv_int8.case_named({case.name!r})\n    out = {fn_name}(*args)")
        # The engine hands attention the same pages every step, written in place between steps.
        held = int8_args(reused[0])
        for case in reused:
            for t, new in zip(held[:8], int8_args(case)):
                t.copy_(new)  # the same objects (and id()s), this step's contents
            run(case, held, "To replay: from minipaged.checks import kv_int8, paged_attention as pa\n    first, second "
                            f"= pa.reused_cases()\n    args = kv_int8.int8_args(first)\n    out = {fn_name}(*args)\n"
                            "    for t, new in zip(args[:8], kv_int8.int8_args(second)): t.copy_(new)\n"
                            f"    out = {fn_name}(*args)")

    run_guarded("04", NAME, _body, timeout, state)
    passed(f"paged attention over int8 pages: {len(cases) + len(reused)} cases (prefill, decode, GQA, a mixed batch, "
           f"block size 16, a random batch, SmolLM2's max_model_len of {MAX_MODEL_LEN}, the same pages changed in "
           "place and handed in again) matched minipaged's reference reading the same pages.")


__all__ = ["check_quantize", "check_copy_block", "check_gather_kv_int8", "check_paged_attention_int8",
           "quantized_case", "ref_pages", "case_named", "int8_args"]

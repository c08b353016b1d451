"""Checks for workbook 04: a learner's gather_kv and paged_attention against the reference.

Cases run from simple to hard (one sequence, decode, GQA, a chunk over a cached prefix, a
mixed batch, huge logits), on caches whose unused slots hold garbage and whose block tables
are out of order. When an output differs, the check also runs the reference with one
classic mistake switched on (no causal offset, GQA by modulo, logical blocks, unmasked last
block, no scale); if yours matches one of those, the hint names it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..attention.reference import gather_kv as ref_gather_kv
from ..attention.reference import paged_attention as ref_paged_attention
from ._core import DEFAULT_TIMEOUT_S, SITUATIONS, CheckFailed, builds, failure, fmt_list, learner_call, passed
from ._core import length_situations as core_length_situations
from ._delegation import refuse_package_function, run_guarded

NAME = "04 paged attention"
MAX_MODEL_LEN = 2048  # a long context, past any window a learner might cap at (SmolLM2-135M serves 8,192; shorter keeps the check fast)
# The situations of workbooks 04 and 05's rules that _core's vocabulary does not name (issue 40).
SITUATIONS.update({
    "grouped heads": "grouped-query attention with more than one KV head: each KV head serves a group of query heads",
    "cached prefix": "new tokens after tokens already in the cache (a chunk, a decode): query i sits at position "
                     "context_len - q_len + i, not at i",
    "given scale": "a scale argument other than 1/sqrt(head_dim), so only the one given is right",
    "signed scores": "scores of one sign only (every q.k large and negative) and of both signs around 0",
    "block size under heads": "a cache with fewer slots in a block than KV heads, so one dimension read for the "
                              "other shows",
})


@dataclass
class Case:
    """One batch of inputs in the reference signature, plus what it is meant to test."""

    name: str
    focus: str  # the hint when this case is the first to fail and no known mistake matches
    q: torch.Tensor  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32
    context_lens: torch.Tensor  # (num_seqs,) int32
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32
    scale: float
    seqs: list = field(default_factory=list)  # [(context_len, q_len)]
    situations: tuple = ()  # those its inputs do not show (see situations_of)

    def cpu(self) -> "Case":
        if self.q.device.type == "cpu":
            return self
        c = Case(**{**self.__dict__})
        for name in ("q", "k_cache", "v_cache", "block_tables", "context_lens", "query_start_loc"):
            setattr(c, name, getattr(self, name).cpu())
        return c

    def args(self) -> tuple:
        return (self.q.clone(), self.k_cache.clone(), self.v_cache.clone(), self.block_tables.clone(),
                self.context_lens.clone(), self.query_start_loc.clone(), self.scale)

    def describe(self) -> str:
        nb, bs, hkv, d = self.k_cache.shape
        h = self.q.shape[1]
        lines = [f"{len(self.seqs)} sequence(s), block_size {bs}, {h} query head(s) over {hkv} KV head(s), head_dim {d}, "
                 f"scale {self.scale:.4g}, cache of {nb} blocks"]
        for s, (c, ql) in enumerate(self.seqs):
            nblk = -(-c // bs)
            row = fmt_list(self.block_tables[s, :nblk].tolist())
            kind = "decode" if ql == 1 and c > 1 else ("prefill" if ql == c else "chunk over a cached prefix")
            lines.append(f"  sequence {s}: context_len {c}, {ql} new token(s) ({kind}; rows "
                         f"{int(self.query_start_loc[s])}..{int(self.query_start_loc[s + 1]) - 1} of q), "
                         f"block table {row}")
        return "\n".join(lines)


def make_case(name: str, focus: str, seqs: list, num_heads: int = 2, num_kv_heads: int = 1, head_dim: int = 8,
              block_size: int = 4, seed: int = 0, logit_scale: float = 1.0, in_order: bool = False,
              spare_blocks: int = 3, scale: float | None = None, situations: tuple = ()) -> Case:
    """Random inputs for ``seqs`` = [(context_len, q_len), ...]; unused cache slots hold garbage."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c, _ in seqs]
    num_blocks = sum(need) + spare_blocks
    ids = torch.arange(num_blocks) if in_order else torch.randperm(num_blocks, generator=g)
    width = max(need)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 8 + 5  # garbage
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 50 + 20
    used = 0
    for s, (c, _) in enumerate(seqs):
        blocks = ids[used: used + need[s]]
        used += need[s]
        tables[s, : need[s]] = blocks.to(torch.int32)
        for p in range(c):
            b, o = int(blocks[p // block_size]), p % block_size
            k_cache[b, o] = torch.randn(num_kv_heads, head_dim, generator=g)
            v_cache[b, o] = torch.randn(num_kv_heads, head_dim, generator=g)
    q_lens = [ql for _, ql in seqs]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g) * logit_scale
    if logit_scale != 1.0:
        k_cache = k_cache * logit_scale
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return Case(name, focus, q, k_cache, v_cache, tables, torch.tensor([c for c, _ in seqs], dtype=torch.int32), qsl,
                1.0 / math.sqrt(head_dim) if scale is None else scale, list(seqs), situations)


def length_situations(context_lens: list, block_size: int) -> list[str]:
    """The SITUATIONS contexts of these lengths put a gather or an attention in (against SmolLM2's max_model_len)."""
    return core_length_situations(context_lens, block_size, MAX_MODEL_LEN)


def situations_of(case: Case, queries: bool = True) -> list[str]:
    """The SITUATIONS ``case`` puts a learner's code in, read off its inputs (``queries``: an attention's, beyond
    a gather's), with those its maker named."""
    _, bs, hkv, _ = case.k_cache.shape
    out = length_situations([c for c, _ in case.seqs], bs) + list(case.situations)
    rows = [case.block_tables[s, : -(-c // bs)].tolist() for s, (c, _) in enumerate(case.seqs)]
    if any(a > b for row in rows for a, b in zip(row, row[1:])):
        out.append("out-of-order blocks")
    if bs < hkv:
        out.append("block size under heads")
    if queries and hkv > 1 and case.q.shape[1] > hkv:
        out.append("grouped heads")
    if queries and any(ql < c for c, ql in case.seqs):
        out.append("cached prefix")
    return out


# -- the reference with one mistake switched on (for hints only) ---------------------------------
def variant_attention(case: Case, causal: str = "suffix", gqa: str = "div", blocks: str = "table",
                      partial: str = "mask", scaled: bool = True, masked_to: float = float("-inf")) -> torch.Tensor:
    q, kc, vc, bt, ctx, qsl, scale = case.args()
    nb, bs, hkv, d = kc.shape
    h = q.shape[1]
    group = h // hkv
    out = torch.zeros_like(q)
    for s, (c, ql) in enumerate(case.seqs):
        q0 = int(qsl[s])
        nblk = -(-c // bs)
        row = bt[s, :nblk].long() if blocks == "table" else torch.arange(nblk)
        if blocks == "logical" and int(row.max()) >= nb:
            row = row.clamp(max=nb - 1)
        n_keys = c if partial == "mask" else nblk * bs
        k = kc[row].reshape(-1, hkv, d)[:n_keys].float()
        v = vc[row].reshape(-1, hkv, d)[:n_keys].float()
        heads = torch.arange(h) // group if gqa == "div" else torch.arange(h) % hkv
        k, v = k[:, heads], v[:, heads]
        scores = torch.einsum("qhd,khd->hqk", q[q0:q0 + ql].float(), k) * (scale if scaled else 1.0)
        first = c - ql if causal == "suffix" else 0
        q_pos = torch.arange(first, first + ql).unsqueeze(1)
        k_pos = torch.arange(n_keys).unsqueeze(0)
        if causal != "none" and not (partial == "whole" and ql == 1):
            scores = scores.masked_fill(k_pos > q_pos, masked_to)
        out[q0:q0 + ql] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out


MISTAKES = [
    (dict(causal="prefix"),
     "your output is what you get when query i may see keys 0..i, as if nothing were cached. The new tokens are the LAST "
     "q_len positions of the context: query i sits at position context_len - q_len + i and sees keys 0 .. context_len - q_len + i."),
    (dict(causal="none"),
     "your output matches attention WITHOUT the causal mask: a new token may not see the tokens after it. Before the softmax "
     "set scores[k_pos > q_pos] = -inf, with q_pos = context_len - q_len + i."),
    (dict(gqa="mod"),
     "your output matches GQA with the wrong KV head: query head h reads KV head h // (num_heads // num_kv_heads) (consecutive "
     "query heads share one KV head: k.repeat_interleave(group, dim=1)), not h % num_kv_heads (what k.repeat(1, group, 1) gives)."),
    (dict(blocks="logical"),
     "your output matches reading the blocks in logical order (block i for logical block i): the block table was ignored. "
     "Logical block i of sequence s lives in physical block block_tables[s, i]."),
    (dict(partial="whole"),
     "your output matches attending to EVERY slot of the last block, also the ones past context_len. The last block is only "
     "partly filled; the slots after the sequence's end hold garbage (another sequence's or stale data). Keep only the first "
     "context_len gathered tokens, or mask keys at positions >= context_len (a decode step needs that mask too)."),
    (dict(masked_to=0.0),
     "your output matches masking the future keys with a score of 0 instead of -inf: 0 is a real score (scores have "
     "both signs), so exp(0) = 1 still gives those keys weight. Fill them with float('-inf'), whose exp() is exactly 0."),
    (dict(scaled=False),
     "your output matches attention without the scale: multiply q·k by `scale` (1/sqrt(head_dim)) before the softmax."),
]


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol))


def _max_score(case: Case) -> float:
    q, kc, _, bt, _, qsl, scale = case.args()
    bs, hkv = kc.shape[1], kc.shape[2]
    best = 0.0
    for s, (c, ql) in enumerate(case.seqs):
        k = ref_gather_kv(kc, bt[s], c).float().repeat_interleave(q.shape[1] // hkv, dim=1)
        sc = torch.einsum("qhd,khd->hqk", q[int(qsl[s]): int(qsl[s]) + ql].float(), k) * scale
        best = max(best, sc.abs().max().item())
    return best


def _row_scores(case: Case, t: int, h: int) -> tuple[int, torch.Tensor]:
    """(sequence, the scaled scores of query row ``t``, head ``h`` over the keys it may see)."""
    q, kc, _, bt, _, qsl, scale = case.args()
    hkv = kc.shape[2]
    s = max(i for i in range(len(case.seqs)) if int(qsl[i]) <= t)
    c, ql = case.seqs[s]
    k = ref_gather_kv(kc, bt[s], c).float()[:, h // (q.shape[1] // hkv)]
    pos = c - ql + (t - int(qsl[s]))
    return s, (k[: pos + 1] @ q[t, h].float()) * scale


def _nan_hint(case: Case, got: torch.Tensor) -> str:
    bad = (~torch.isfinite(got)).nonzero()
    t, h = int(bad[0, 0]), int(bad[0, 1])
    rows = sorted({int(r) for r in bad[:, 0]})
    s, sc = _row_scores(case, t, h)
    c, ql = case.seqs[s]
    pos = c - ql + (t - int(case.query_start_loc[s]))
    where = (f"row {t} of the output is NaN or inf (out[{t}, {h}], sequence {s}, position {pos} of {c}; "
             f"{len(rows)} row(s) in all, first {fmt_list(rows[:6])}) where the reference is finite")
    hi, lo = sc.max().item(), sc.min().item()
    if hi > 80:
        return (f"{where}. Its scores reach {hi:.0f}; exp() of anything above 88 overflows float32 to inf, and inf/inf is "
                "NaN. Subtract each row's maximum before exp (softmax(x) == softmax(x - max(x))), or call torch.softmax, "
                "which does. Compute in float32.")
    if hi < -80:
        return (f"{where}. Every score of that row is negative, between {lo:.0f} and {hi:.0f}: exp() of each underflows to 0, "
                "so the sum is 0 and 0/0 is NaN. Subtract the row's own maximum, not 0 (start a running maximum at -inf, "
                "never at 0): then the largest term is exp(0) = 1.")
    return (f"{where}, and its scores are moderate ({lo:.1f} .. {hi:.1f}): a softmax over an all -inf row? Query "
            f"position {pos} sees keys 0 .. {pos}, so its row always keeps at least key {pos} (is your mask k_pos >= q_pos, "
            "which hides the key at the query's own position?). Masked keys beyond context_len must be -inf before the "
            "softmax and must not divide by a zero sum.")


def _pattern_hint(case: Case, got: torch.Tensor, exp: torch.Tensor, atol: float, rtol: float) -> str | None:
    """What the wrong entries have in common: some heads only (GQA), or some sequences only (their lengths)."""
    wrong = ((got.float() - exp.float()).abs() > atol + rtol * exp.abs())  # (tokens, heads, dim)
    per_head = wrong.any(-1)  # (tokens, heads)
    h, hkv = case.q.shape[1], case.k_cache.shape[2]
    bad_heads = sorted(int(x) for x in per_head.any(0).nonzero().flatten())
    rows = per_head.any(1)
    if 0 < len(bad_heads) < h and bool((per_head[rows].sum(1) < h).all()):
        group = h // hkv
        want = [hh // group for hh in range(h)]
        return (f"only query heads {fmt_list(bad_heads)} of {h} are wrong, the others are right in the same rows: a head "
                f"mapping error, not the blocks or the mask. With {h} query heads over {hkv} KV heads (groups of {group}), "
                f"query head h reads KV head h // {group}: {fmt_list(want)}.")
    qsl = case.query_start_loc.tolist()
    bs = case.k_cache.shape[1]
    bad_seqs = [s for s in range(len(case.seqs)) if bool(rows[qsl[s]:qsl[s + 1]].any())]
    good_seqs = [s for s in range(len(case.seqs)) if s not in bad_seqs]
    if bad_seqs and good_seqs:
        on = [s for s in bad_seqs if case.seqs[s][0] % bs == 0]
        if len(on) == len(bad_seqs) and all(case.seqs[s][0] % bs for s in good_seqs):
            return (f"only sequences whose context ends exactly on a block boundary are wrong ({fmt_list(bad_seqs)}; block "
                    f"size {bs}): {case.seqs[bad_seqs[0]][0]} tokens use exactly {case.seqs[bad_seqs[0]][0] // bs} whole blocks. "
                    "Count blocks with ceil(context_len / block_size) = -(-context_len // block_size), and keep slots < context_len.")
    return None


def diagnose(case: Case, got: torch.Tensor, atol: float, rtol: float) -> str:
    if not torch.isfinite(got).all():
        return _nan_hint(case, got)
    ref = variant_attention(case)
    for kwargs, hint in MISTAKES:
        try:
            alt = variant_attention(case, **kwargs)
        except Exception:  # a variant that makes no sense for this case
            continue
        if not _close(alt, ref, atol, rtol) and _close(got, alt, atol * 10, rtol * 10):
            return hint
    pattern = _pattern_hint(case, got, ref_paged_attention(*case.args()), atol, rtol)
    return pattern or case.focus


# -- cases ----------------------------------------------------------------------------------
def attention_cases(decode_only: bool = False) -> list[Case]:
    c = []
    if not decode_only:
        c.append(make_case("prefill of one short sequence (5 tokens, 2 blocks of 4, in order)",
                           "start here: gather the sequence's keys and values, scores = q @ k^T * scale, causal mask, softmax, @ v.",
                           [(5, 5)], num_heads=1, num_kv_heads=1, in_order=True, seed=1))
    c.append(make_case("decode: 1 new token over 9 cached, blocks in order",
                       "a decode query is the LAST position of the context: it sees all context_len keys.",
                       [(9, 1)], num_heads=1, num_kv_heads=1, in_order=True, seed=2))
    c.append(make_case("decode through an out-of-order block table",
                       "logical block i lives in physical block block_tables[s, i]; read blocks through the table.",
                       [(11, 1)], num_heads=1, num_kv_heads=1, seed=3))
    c.append(make_case("decode with GQA: 4 query heads over 2 KV heads",
                       "query head h reads KV head h // (num_heads // num_kv_heads).",
                       [(7, 1)], num_heads=4, num_kv_heads=2, seed=4))
    c.append(make_case("decode, context ends exactly on a block boundary (8 tokens, block size 4)",
                       "a context of exactly n * block_size tokens uses n whole blocks and no part of another.",
                       [(8, 1)], num_heads=2, num_kv_heads=2, seed=5))
    c.append(make_case("decode batch of 3 sequences with different lengths",
                       "each sequence has its own block table row and context_len; query row s belongs to sequence s.",
                       [(3, 1), (13, 1), (6, 1)], num_heads=6, num_kv_heads=2, seed=6))
    if not decode_only:
        c.append(make_case("prefill with GQA: 6 query heads over 3 KV heads",
                           "each new token i may see keys 0..i; query head h reads KV head h // group.",
                           [(10, 10)], num_heads=6, num_kv_heads=3, seed=7))
        c.append(make_case("chunk: 3 new tokens over a cached prefix of 6",
                           "the 3 new tokens are positions 6, 7, 8: query i sees keys 0 .. 6 + i.",
                           [(9, 3)], num_heads=2, num_kv_heads=1, seed=8))
        c.append(make_case("mixed batch: a prefill, a decode and a chunk, packed by query_start_loc",
                           "sequence s owns rows query_start_loc[s] : query_start_loc[s+1] of q and out.",
                           [(6, 6), (14, 1), (11, 4)], num_heads=4, num_kv_heads=2, head_dim=16, seed=9))
    c.append(make_case("huge logits (scores in the hundreds)",
                       "subtract the row maximum before exp(): softmax(x) == softmax(x - max(x)).",
                       [(12, 1), (7, 1)] if decode_only else [(12, 4), (7, 1)],
                       num_heads=2, num_kv_heads=1, head_dim=16, seed=10, logit_scale=12.0,
                       situations=("numerical edge",)))
    c.append(_signed_case("scores of one sign only: every q.k is negative and large (-100 and below)",
                          "the row's maximum is negative: subtract it (start a running maximum at -inf, never 0).",
                          [(9, 1), (20, 1)] if decode_only else [(9, 3), (20, 1)], sign=-1.0, seed=11,
                          situations=("signed scores", "numerical edge")))
    c.append(_signed_case("scores of both signs (-4 .. 4), so that 0 is a score like any other",
                          "masked keys are -inf, never 0: here 0 is a real score, larger than many.",
                          [(13, 1), (6, 1)] if decode_only else [(13, 5), (6, 6)], sign=0.0, seed=12, size=0.2,
                          situations=("signed scores",)))
    c.append(make_case("a scale that is not 1/sqrt(head_dim) (0.9: some models scale otherwise)",
                       "multiply the scores by the `scale` argument as given; never compute 1/sqrt(head_dim) yourself.",
                       [(9, 1), (5, 1)] if decode_only else [(9, 3), (5, 5)], num_heads=2, num_kv_heads=1, head_dim=16,
                       seed=15, scale=0.9, situations=("given scale",)))
    c.append(make_case("block size 2 under 4 KV heads (more KV heads than slots in a block)",
                       "the cache is (num_blocks, block_size, num_kv_heads, head_dim): block_size is shape[1], whatever "
                       "the number of KV heads.",
                       [(7, 1), (4, 1)] if decode_only else [(7, 2), (4, 4)], num_heads=8, num_kv_heads=4, head_dim=8,
                       block_size=2, seed=16))
    seqs16 = [(15, 1), (16, 1), (17, 1), (32, 1), (33, 1), (5, 1)]
    c.append(make_case("block size 16: contexts 15, 16, 17, 32, 33 and 5 (on, before and past each block boundary)",
                       "a context of exactly n * block_size tokens uses n whole blocks; one more token opens block n + 1.",
                       seqs16, num_heads=9, num_kv_heads=3, head_dim=16, block_size=16, seed=13))
    if not decode_only:
        c.append(make_case("prefill lengths that are not multiples of 16: 19 new over 37, 23 over 23, 7 over 40 (block size 16)",
                           "new token i sits at position context_len - q_len + i; tiles of 16 must mask the rows and keys past the end.",
                           [(37, 19), (23, 23), (40, 7)], num_heads=9, num_kv_heads=3, head_dim=16, block_size=16, seed=14))
    for i in range(3):
        g = torch.Generator().manual_seed(100 + i)
        n = int(torch.randint(1, 5, (1,), generator=g))
        seqs = []
        for _ in range(n):
            ctx = int(torch.randint(1, 40, (1,), generator=g))
            ql = 1 if decode_only else int(torch.randint(1, ctx + 1, (1,), generator=g))
            seqs.append((ctx, ql))
        hkv = [1, 2, 2][i]
        c.append(make_case(f"random batch {i + 1} of 3", "compare with the cases above that passed.", seqs,
                           num_heads=hkv * [1, 2, 4][i], num_kv_heads=hkv, head_dim=[8, 16, 32][i],
                           block_size=[4, 8, 16][i], seed=200 + i))
    # Last, so that every mistake the cases above show is named there, on small inputs.
    # Blocks of 64: Triton's interpreter takes about 8 ms a block, per sequence and head.
    c.append(make_case(f"at SmolLM2's max_model_len: a context of {MAX_MODEL_LEN} tokens (32 blocks of 64)",
                       "the longest sequence the engine serves: no buffer, mask or position may stop short of "
                       f"max_model_len ({MAX_MODEL_LEN}).",
                       [(MAX_MODEL_LEN, 1 if decode_only else MAX_MODEL_LEN)],
                       num_heads=2, num_kv_heads=1, head_dim=8, block_size=64, seed=18))
    return c


def reused_cases() -> tuple[Case, Case]:
    """Two decode steps on one set of tensors, as the engine runs them: the check hands the learner the same
    objects twice, the second time with ``second``'s contents written into them in place. Between the steps
    sequence 0 finished and its blocks went, in another order, to a new request of 5 tokens (the old tokens
    stay in the slots past its end), sequence 1 wrote its 8th token, and new queries came."""
    first = make_case("the same tensors, handed in twice: step 1, decodes over contexts of 10 and 7",
                      "compare with the cases above that passed.", [(10, 1), (7, 1)], num_heads=4, num_kv_heads=2,
                      seed=17)
    g = torch.Generator().manual_seed(1017)
    bs, hkv, d = first.k_cache.shape[1:]
    old, mine = first.block_tables[0, :3].tolist(), first.block_tables[1, :2].tolist()
    k, v, tables = first.k_cache.clone(), first.v_cache.clone(), first.block_tables.clone()
    tables[0, :2] = torch.tensor([old[2], old[0]], dtype=torch.int32)  # freed, then allocated again
    for p in range(5):
        b, o = int(tables[0, p // bs]), p % bs
        k[b, o], v[b, o] = torch.randn(hkv, d, generator=g), torch.randn(hkv, d, generator=g)
    k[mine[1], 3], v[mine[1], 3] = torch.randn(hkv, d, generator=g), torch.randn(hkv, d, generator=g)
    second = Case("the same tensors, handed in again after the engine changed them in place: step 2, a new request of "
                  "5 tokens in the freed blocks of the first, the other sequence grown to 8",
                  "the engine hands attention the same k_cache, v_cache and block_tables every step, written in "
                  "place between steps: read them afresh on every call. Keep nothing between calls (a memo keyed on "
                  "id() or data_ptr() meets new contents under the same key).",
                  torch.randn(first.q.shape, generator=g), k, v, tables, torch.tensor([5, 8], dtype=torch.int32),
                  first.query_start_loc.clone(), first.scale, [(5, 1), (8, 1)], ("reused object",))
    return first, second


def _signed_case(name: str, focus: str, seqs: list, sign: float, seed: int, size: float = 10.0,
                 situations: tuple = ()) -> Case:
    """Scores of one sign (``sign`` = -1 or 1: q.k all that sign) or both (``sign`` = 0), of magnitude
    about 10 * ``size`` .. 15 * ``size`` after the scale (``size`` 10: 100 .. 150)."""
    case = make_case(name, focus, seqs, num_heads=2, num_kv_heads=1, head_dim=16, seed=seed, situations=situations)
    g = torch.Generator().manual_seed(seed + 1000)
    d = case.q.shape[-1]
    direction = torch.ones(d) / math.sqrt(d)
    q = direction.expand_as(case.q) * 40.0 + 0.3 * torch.randn(case.q.shape, generator=g)
    k = case.k_cache.clone()
    mag = size * (1.0 + 0.5 * torch.rand(k.shape[:-1], generator=g))
    signs = torch.full(k.shape[:-1], sign) if sign else torch.where(torch.rand(k.shape[:-1], generator=g) < 0.5, -1.0, 1.0)
    k = direction * (signs * mag).unsqueeze(-1) + 0.3 * torch.randn(k.shape, generator=g)
    case.q, case.k_cache = q, k  # scaled scores = q.k / 4: magnitudes of about 100 .. 150, the given signs
    return case


def compare_case(case: Case, got, name: str, fn_name: str, atol: float, rtol: float, replay: str | None = None) -> None:
    case = case.cpu()  # the oracle and the pictures run on the CPU, whatever device the learner's code used
    if isinstance(got, torch.Tensor):
        got = got.detach().cpu()
    exp = ref_paged_attention(*case.args())
    call = f"{fn_name}(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)"
    replay = replay or (f"To replay: from minipaged.checks import paged_attention as pa\n"
              f"    case = pa.case_named({case.name!r}{', decode_only=True' if name.startswith('05') else ''})\n"
              f"    out = {fn_name}(*case.args())")
    if got is None:
        raise failure(f"{name}: case \"{case.name}\": {fn_name} returned None.", done=case.describe(),
                      hint="return the output tensor (shape (num_tokens, num_heads, head_dim)); filling `out` without returning it is not enough.")
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(exp.shape):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise failure(f"{name}: case \"{case.name}\": the output has the wrong shape.", done=case.describe(),
                      expected=f"shape {tuple(exp.shape)} = (num_tokens, num_heads, head_dim), like q",
                      got=f"{shape}", hint="one output row per query row, one head per query head.")
    if _close(got, exp, atol, rtol):
        return
    diff = (got.float() - exp.float()).abs()
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, float("inf")))
    tol = atol + rtol * exp.abs()
    bad = (diff > tol).nonzero()
    t, hh = bad[0, 0].item(), bad[0, 1].item()
    qsl = case.query_start_loc.tolist()
    s = max(i for i in range(len(qsl) - 1) if qsl[i] <= t)
    ctx, ql = case.seqs[s]
    pos = ctx - ql + (t - qsl[s])
    k = min(4, exp.shape[-1])
    raise failure(
        f"{name}: case \"{case.name}\" differs from the reference.",
        done="Inputs: " + case.describe(),
        expected=f"out[{t}, {hh}, :{k}] = {fmt_list(f'{x:.4f}' for x in exp[t, hh, :k].tolist())}",
        got=f"out[{t}, {hh}, :{k}] = {fmt_list(f'{x:.4f}' for x in got[t, hh, :k].float().tolist())}",
        picture=(f"That is sequence {s}, its new token {t - qsl[s]} (position {pos} of {ctx}), query head {hh}. "
                 f"{len(bad)} of {exp.numel()} output values are off; the largest difference is {diff.max().item():.3g} "
                 f"(tolerance {atol:g} + {rtol:g} * |expected|).\n" + replay),
        hint=diagnose(case, got, atol, rtol),
    )


def case_named(name: str, decode_only: bool = False) -> Case:
    """The check's case ``name``, to replay it in a cell."""
    for c in attention_cases(decode_only):
        if c.name == name:
            return c
    raise KeyError(f"no case {name!r}; the cases are: {[c.name for c in attention_cases(decode_only)]}")


# -- the checks ----------------------------------------------------------------------------
def check_gather_kv(gather_kv: Callable, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``gather_kv(cache, block_table_row, context_len)`` -> (context_len, num_kv_heads, head_dim)."""
    refuse_package_function(gather_kv, NAME, "gather_kv")
    # (context_len, blocks in order, block_size, num_kv_heads): the next to last has more KV heads than slots in a
    # block; the last is SmolLM2's max_model_len
    cases = [(5, True, 4, 2), (11, False, 4, 2), (8, False, 4, 2), (1, False, 4, 2), (16, False, 4, 2), (23, False, 4, 2),
             (7, False, 2, 4), (MAX_MODEL_LEN, False, 16, 2)]
    state = {"current": "gather_kv(...)"}

    def gather(cache: torch.Tensor, row: torch.Tensor, ctx: int, again: str = "", stale=None) -> torch.Tensor:
        """``gather_kv`` on these very objects against the reference; ``again`` says how they changed since the
        call that gave ``stale``. Returns the reference's answer."""
        what = f"gather_kv(k_cache, block_table={fmt_list(row.tolist())}, context_len={ctx})"
        state["current"] = what
        exp = ref_gather_kv(cache, row, ctx)
        got = learner_call(gather_kv, cache, row, ctx, what=what)
        bs = cache.shape[1]
        desc = (f"k_cache of shape {tuple(cache.shape)} (num_blocks, block_size, num_kv_heads, head_dim), "
                f"block size {bs}{again}")
        if not isinstance(got, torch.Tensor):
            raise failure(f"{NAME}: {what} returned {type(got).__name__}.", done=desc,
                          expected=f"a tensor of shape {tuple(exp.shape)}", got=repr(got)[:80],
                          hint="return the gathered tokens as one tensor.")
        if tuple(got.shape) != tuple(exp.shape):
            h = ("you kept every slot of the last block: cut the result to the first context_len tokens ([:context_len])."
                 if got.dim() == 3 and got.shape[0] == -(-ctx // bs) * bs else
                 f"you gathered {got.shape[0]:,} of the {ctx:,} tokens of a long context: something caps the length (a "
                 "window, a buffer of fixed size). Contexts run to max_model_len (8,192 for SmolLM2-135M): gather every "
                 "block of the table up to context_len."
                 if got.dim() == 3 and ctx > 1024 and 0 < got.shape[0] < ctx else
                 "index the cache with the sequence's blocks (cache[block_table[:n_blocks]]), flatten the first two "
                 "dims (n_blocks * block_size tokens), then keep the first context_len.")
            raise failure(f"{NAME}: {what} has the wrong shape.", done=desc,
                          expected=f"{tuple(exp.shape)} = (context_len, num_kv_heads, head_dim)",
                          got=f"{tuple(got.shape)}", hint=h)
        if not torch.equal(got, exp):
            tok = int((got != exp).flatten(1).any(1).nonzero()[0])
            blk, off = tok // bs, tok % bs
            logical = cache.reshape(-1, *cache.shape[2:])[:ctx] if ctx <= cache.shape[0] * bs else None
            if stale is not None and torch.equal(got, stale):
                h = ("you returned what the call before gave: the cache is the same object, changed in place since "
                     "(the engine writes into one cache every step). Gather from it afresh on every call; keep "
                     "nothing between calls keyed on id() or data_ptr().")
            elif logical is not None and torch.equal(got, logical):
                h = "you read the blocks in logical order (0, 1, 2, ...): take logical block i from physical block block_table[i]."
            else:
                h = (f"token {tok} is logical block {blk}, offset {off}: it lives at cache[block_table[{blk}], {off}] = "
                     f"cache[{int(row[blk])}, {off}].")
            raise failure(f"{NAME}: {what}: token {tok} is the wrong one.", done=desc,
                          expected=f"cache[{int(row[blk])}, {off}] (block_table[{blk}] = {int(row[blk])}, offset {off})",
                          got="other values", hint=h)
        return exp

    def _body():
        builds("package code in place")
        for i, (ctx, in_order, bs, hkv) in enumerate(cases):
            case = make_case("gather", "", [(ctx, 1)], num_heads=hkv, num_kv_heads=hkv, head_dim=4, block_size=bs,
                             seed=30 + i, in_order=in_order)
            builds(*situations_of(case, queries=False))
            gather(case.k_cache.clone(), case.block_tables[0].clone(), ctx)
        # The engine gathers from one cache every step, written in place between steps: the same objects with new
        # contents must give the new tokens (a memo keyed on id() or data_ptr() gives the old ones).
        case = make_case("gather", "", [(11, 1)], num_heads=2, num_kv_heads=2, head_dim=4, seed=37)
        cache, row = case.k_cache.clone(), case.block_tables[0].clone()
        before = gather(cache, row, 11)
        blk = int(row[1])
        cache[blk] = cache[blk] * -2.0 + 1.0
        builds("reused object")
        gather(cache, row, 11, stale=before, again=f"; the same k_cache and block_table objects as the call before, "
                                                   f"block {blk} of the cache rewritten in place since")

    run_guarded("04", NAME, _body, timeout, state)
    passed(f"gather_kv: {len(cases)} block tables (in order, shuffled, exact block boundary, one token, more KV heads "
           f"than slots in a block, SmolLM2's max_model_len of {MAX_MODEL_LEN}) and a cache changed in place and "
           "handed in again matched the reference.")


def check_attention_fn(fn: Callable, name: str, cases: list, timeout: float, atol: float, rtol: float,
                       fn_name: str = "paged_attention", before: Callable[[], None] | None = None,
                       workbook: str = "04", reused: tuple[Case, Case] | None = None) -> int:
    """``fn`` on ``cases``, then on ``reused`` (see reused_cases): one set of tensors handed in for each of its
    steps, written in place with that step's contents. Returns the number of cases run."""
    refuse_package_function(fn, name, fn_name)
    state = {"current": "the first case"}
    replay_reused = None if reused is None else (
        f"To replay: from minipaged.checks import paged_attention as pa\n    first, second = pa.reused_cases()\n"
        f"    args = first.args()\n    out = {fn_name}(*args)\n"
        f"    for t, new in zip(args[:6], second.args()): t.copy_(new)\n    out = {fn_name}(*args)")

    def run(case: Case, args: tuple, replay: str | None = None) -> None:
        builds(*situations_of(case))
        state["current"] = f'{fn_name}(...) on case "{case.name}"'
        got = learner_call(fn, *args, what=f'{fn_name}(...) on case "{case.name}"',
                           context=lambda case=case: "Inputs: " + case.describe())
        if not torch.equal(args[1], case.k_cache) or not torch.equal(args[2], case.v_cache):
            raise failure(f"{name}: {fn_name} changed k_cache or v_cache (case \"{case.name}\").", done=case.describe(),
                          hint="attention only reads the cache; the new K/V were written before it is called. "
                               "Work on gathered copies, never assign into the cache.")
        compare_case(case, got, name, fn_name, atol, rtol, replay)

    def _body():
        builds("package code in place")
        if before is not None:
            before()
        for case in cases:
            run(case, case.args())
        if reused is not None:
            held = reused[0].args()
            for case in reused:
                for t, new in zip(held[:6], case.args()):
                    t.copy_(new)  # the same objects (and id()s), this step's contents
                run(case, held, replay_reused)

    # Triton's interpreter runs about 3x slower under the call watch: there the first cases are watched
    # (one and many blocks, GQA), which is where a wrapper around minipaged's kernels would show.
    run_guarded(workbook, name, _body, timeout, state, max_calls=4 if workbook == "05" else None)
    return len(cases) + len(reused or ())


def check_paged_attention(paged_attention: Callable, timeout: float = DEFAULT_TIMEOUT_S,
                          atol: float = 1e-4, rtol: float = 1e-4) -> None:
    """``paged_attention`` with the reference signature, on prefill, decode, GQA, chunks and mixed batches."""
    n = check_attention_fn(paged_attention, NAME, attention_cases(), timeout, atol, rtol, reused=reused_cases())
    passed(f"paged attention: {n} cases (prefill, decode, GQA, a chunk over a cached prefix, a mixed batch, huge logits, "
           f"a scale of 0.9, block size 2 under 4 KV heads, random batches, SmolLM2's max_model_len of "
           f"{MAX_MODEL_LEN}, the same tensors changed in place and handed in again) matched the reference.")


def check(gather_kv: Callable, paged_attention: Callable, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    check_gather_kv(gather_kv, timeout=timeout)
    check_paged_attention(paged_attention, timeout=timeout)


__all__ = ["check", "check_gather_kv", "check_paged_attention", "attention_cases", "case_named", "make_case",
           "reused_cases", "situations_of", "MAX_MODEL_LEN"]

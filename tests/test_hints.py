"""Each class of attention hint points at its actual cause, on the case where the mistake shows.

The output given to ``compare_case`` is the reference's with exactly one fault put in, so the
hint is chosen by what the check observes, never by which case failed first:

- NaN from overflow (scores above 88), NaN from underflow (every score large and negative),
  NaN from an all -inf row (moderate scores): three different messages, each saying where;
- a head-mapping (GQA) error on a block-boundary case gets the head hint, never the boundary one;
- an error only in the sequences whose context ends on a block boundary gets the boundary hint;
- a known mistake (masking with 0) is named even where its case's focus says something else.
"""
from __future__ import annotations

import pytest
import torch

from minipaged.attention.reference import paged_attention as ref
from minipaged.checks import CheckFailed
from minipaged.checks import paged_attention as pa

BOUNDARY = "block size 16: contexts 15, 16, 17, 32, 33 and 5 (on, before and past each block boundary)"


def _hint(case_name: str, got: torch.Tensor) -> str:
    case = pa.case_named(case_name)
    with pytest.raises(CheckFailed) as info:
        pa.compare_case(case, got, pa.NAME, "paged_attention", 1e-4, 1e-4)
    return str(info.value).split("Hint: ", 1)[1]


def _exact(case_name: str) -> torch.Tensor:
    return ref(*pa.case_named(case_name).args())


def test_nan_from_overflow_says_the_scores_are_large() -> None:
    name = "huge logits (scores in the hundreds)"
    case = pa.case_named(name)
    got = _exact(name)
    got[2, 1, 0] = float("nan")
    hint = _hint(name, got)
    assert "row 2 of the output is NaN" in hint and "overflows" in hint, hint
    assert pa._row_scores(case, 2, 1)[1].max() > 80


def test_nan_from_underflow_says_every_score_is_negative() -> None:
    name = "scores of one sign only: every q.k is negative and large (-100 and below)"
    got = _exact(name)
    got[1, 0] = float("nan")
    hint = _hint(name, got)
    assert "row 1 of the output is NaN" in hint and "Every score of that row is negative" in hint, hint
    assert "overflows" not in hint


def test_nan_from_an_empty_row_says_all_minus_inf() -> None:
    name = "prefill of one short sequence (5 tokens, 2 blocks of 4, in order)"
    got = _exact(name)
    got[0] = float("nan")
    hint = _hint(name, got)
    assert "row 0 of the output is NaN" in hint and "a softmax over an all -inf row" in hint, hint
    assert "overflows" not in hint and "underflows" not in hint


def test_gqa_error_on_a_boundary_case_gets_the_head_hint() -> None:
    case = pa.case_named(BOUNDARY)
    got = _exact(BOUNDARY)
    got[:, 4] = got[:, 4] + 1.0  # query head 4 reads the wrong KV head, in every sequence
    hint = _hint(BOUNDARY, got)
    assert "head mapping error" in hint and "[4]" in hint, hint
    assert "boundary" not in hint and "whole blocks" not in hint, hint
    assert case.focus not in hint


def test_error_only_on_boundary_sequences_gets_the_boundary_hint() -> None:
    case = pa.case_named(BOUNDARY)
    got = _exact(BOUNDARY)
    for s, (ctx, _) in enumerate(case.seqs):
        if ctx % 16 == 0:
            got[s] = got[s] + 1.0  # every head of the sequences of 16 and 32 tokens
    hint = _hint(BOUNDARY, got)
    assert "exactly on a block boundary" in hint and "[1, 3]" in hint, hint
    assert "head mapping" not in hint


def test_a_named_mistake_beats_the_case_focus() -> None:
    name = "scores of both signs (-4 .. 4), so that 0 is a score like any other"
    case = pa.case_named(name)
    got = pa.variant_attention(case, masked_to=0.0)
    hint = _hint(name, got)
    assert "instead of -inf" in hint and case.focus not in hint, hint


# -- issue 40: hints name the cause, or list the rules that could explain what differs ---------------------
def _solved(stem: str) -> dict:
    import contextlib
    import io
    from pathlib import Path

    from minipaged.checks._workbooks import run_workbook_cells

    with contextlib.redirect_stdout(io.StringIO()):
        return run_workbook_cells(Path(__file__).resolve().parent.parent / "solutions" / f"{stem}.ipynb")


def test_a_block_back_in_the_free_list_too_early_is_not_told_about_the_empty_free_list() -> None:
    """02: free() of a shared block puts it back on the free list (num_free_blocks counted from the ref counts, so it
    still agrees): when the pool is full, allocate() hands it out again. The hint names that cause (a block in use
    left in the free list), not the empty-free-list check the learner did write."""
    from collections import deque

    from minipaged import BlockAllocatorError, OutOfBlocksError
    from minipaged.checks import block_allocator

    class EarlyBack:
        def __init__(self, num_blocks, block_size=16):
            self.num_blocks, self.block_size = num_blocks, block_size
            self.free_list, self.rc = deque(range(num_blocks)), [0] * num_blocks

        @property
        def num_free_blocks(self):
            return sum(1 for c in self.rc if c == 0)

        def allocate(self):
            if not self.free_list:
                raise OutOfBlocksError("full")
            b = self.free_list.popleft()
            self.rc[b] = 1
            return b

        def free(self, b):
            if self.rc[b] == 0:
                raise BlockAllocatorError(f"block {b} is free")
            self.rc[b] -= 1
            if b not in self.free_list:
                self.free_list.append(b)  # the mistake: back on the list while another holder keeps it

        def incref(self, b):
            if self.rc[b] == 0:
                raise BlockAllocatorError(f"block {b} is free")
            self.rc[b] += 1

        def ref_count(self, b):
            return self.rc[b]

    with pytest.raises(CheckFailed) as info:
        block_allocator.check_sharing(EarlyBack)
    msg = str(info.value)
    assert "when the free list is empty" not in msg, msg
    assert "in use" in msg and ("still held it" in msg or "handed out twice" in msg), msg


@pytest.fixture
def variant_allowed(monkeypatch):
    """The planted proposers run the check's own _variant (each wrong reading, written once): handed over here."""
    from minipaged.checks import _delegation

    monkeypatch.setitem(_delegation.ALLOW, "09", _delegation.ALLOW["09"] + [("minipaged.checks.spec_decode", "_variant")])
    _delegation.allowed.cache_clear()
    yield
    monkeypatch.undo()
    _delegation.allowed.cache_clear()


def _proposer(**flags):
    from minipaged.checks import spec_decode

    def propose_ngram(token_ids, k, min_n, max_n):
        kw = {"min_n": min_n, "max_n": max_n, **flags}  # the reading of min_n or max_n replaces the argument
        return spec_decode._variant(list(token_ids), k, kw.pop("min_n"), kw.pop("max_n"), **kw)

    return propose_ngram


@pytest.mark.parametrize("index", range(8), ids=lambda i: f"reading{i}")
def test_each_wrong_reading_of_the_proposer_gets_its_own_hint(index: int, variant_allowed) -> None:
    """09: a proposer that reads one rule wrongly gets that rule's hint; one whose wrong draft is empty (the suffix
    matched as its own occurrence gives [] on every input) gets the list of rules that could explain it, never one guess."""
    from minipaged.checks import spec_decode

    flags, rule, hint = spec_decode._READINGS[index]
    with pytest.raises(CheckFailed) as info:
        spec_decode.check_proposer(_proposer(**flags), runs=40)
    msg = str(info.value)
    assert hint in msg, msg
    if "The rules that could explain it" in msg:
        assert "your draft is empty" in msg or "more than one wrong reading" in msg, msg


def test_any_wrong_empty_draft_is_not_told_the_suffix_matches_itself(variant_allowed) -> None:
    """09: a proposer that gives up (no draft when the n-gram is longer than 2) is not told one guess."""
    from minipaged.checks import spec_decode

    ref = _proposer()

    def gives_up(token_ids, k, min_n, max_n):
        return [] if max_n > 2 else ref(token_ids, k, min_n, max_n)

    with pytest.raises(CheckFailed) as info:
        spec_decode.check_proposer(gives_up, runs=40)
    msg = str(info.value)
    assert "your draft is empty" in msg, msg
    hint = msg.split("Hint: ", 1)[1]
    assert not hint.startswith("look for the suffix only at positions"), hint

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

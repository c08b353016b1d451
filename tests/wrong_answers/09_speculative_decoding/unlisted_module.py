"""The solved propose_ngram, but it first calls a check's own helper (minipaged.checks._core.plain), package code
the workbook does not hand over: the watch allows, it does not deny, so it is refused."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = _plant.UNLISTED_EXPECT
HINT = None  # a refusal: the message says what to do, with no hint


def answer():
    return (_plant.with_unlisted_call(_plant.solved('09_speculative_decoding')['propose_ngram']),)

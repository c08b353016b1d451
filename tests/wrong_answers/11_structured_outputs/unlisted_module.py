"""The solved choice_mask, but it first calls a check's own helper (minipaged.checks._core.plain), package code the
workbook does not hand over: the watch allows, it does not deny, so it is refused."""
CHECK = "minipaged.checks.structured:check_choice_mask"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _base  # noqa: E402
import _plant  # noqa: E402

EXPECT = _plant.UNLISTED_EXPECT


def answer():
    return (_plant.with_unlisted_call(_base.mask),)

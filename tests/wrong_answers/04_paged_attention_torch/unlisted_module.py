"""The solved gather_kv, but it first calls a check's own helper (minipaged.checks._core.plain), package code
the workbook does not hand over: the watch allows, it does not deny, so it is refused."""
CHECK = "minipaged.checks.paged_attention:check_gather_kv"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = _plant.UNLISTED_EXPECT


def answer():
    return (_plant.with_unlisted_call(_plant.solved('04_paged_attention_torch')['gather_kv']),)

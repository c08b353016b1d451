"""The solved choice_mask behind a memo keyed by the id() of its arguments: the same vocabulary and choice
list changed in place get the mask of what they held before."""
CHECK = "minipaged.checks.structured:check_choice_mask"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["changed in place", "kept by id()"]


def answer():
    return (_plant.memo_by_id(_plant.solved('11_structured_outputs')['choice_mask']),)

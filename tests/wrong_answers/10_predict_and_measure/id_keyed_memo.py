"""The solved goodput behind a memo keyed by the id() of its lists: the same lists, changed in place, get
the goodput of what they held before."""
CHECK = "minipaged.checks.predict:check_goodput"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["changed in place since", "kept by id()"]


def answer():
    return (_plant.memo_by_id(_plant.solved('10_predict_and_measure')['goodput']),)

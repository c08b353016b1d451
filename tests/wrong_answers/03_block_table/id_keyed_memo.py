"""The solved block table, but slot_mapping keeps its answers by (id(self), start, end): a table freed
and grown again into other blocks gets the slots of the blocks it held before."""
CHECK = "minipaged.checks.block_table:check_free"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["before t0 was freed", "a memo keyed by the range"]
HINT = "Something keeps answers from before"


def answer():
    return (_plant.subclass_with(_plant.solved('03_block_table')['MyBlockTable'], 'slot_mapping', _plant.memo_by_id),)

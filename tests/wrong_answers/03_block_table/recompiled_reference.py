"""minipaged's own minipaged.block_table.BlockTable, its module's source compiled again from a file of the learner's: the same
bytecode, names and constants under another file name, refused as minipaged's."""
CHECK = "minipaged.checks.block_table:check_growth"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = _plant.COPY_EXPECT
HINT = None  # a refusal: the message says what to do, with no hint


def answer():
    return (_plant.recompiled('minipaged.block_table', 'BlockTable'),)

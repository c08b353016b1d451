"""minipaged's own minipaged.attention.triton_paged.paged_decode, its module's source compiled again from a file of the learner's: the same
bytecode, names and constants under another file name, refused as minipaged's."""
CHECK = "minipaged.checks.triton_decode:check_decode"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

KWARGS = {"kernel": _plant.solved("05_triton_decode_kernel")["paged_decode_kernel"]}
EXPECT = _plant.COPY_EXPECT


def answer():
    return (_plant.recompiled('minipaged.attention.triton_paged', 'paged_decode'),)

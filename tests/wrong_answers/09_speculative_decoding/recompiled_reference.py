"""minipaged's own minipaged.spec_decode.propose_ngram, its module's source compiled again from a file of the learner's: the same
bytecode, names and constants under another file name, refused as minipaged's."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = _plant.COPY_EXPECT
HINT = None  # a refusal: the message says what to do, with no hint


def answer():
    return (_plant.recompiled('minipaged.spec_decode', 'propose_ngram'),)

"""The solved propose_ngram, but it first stores the token ids in 16 bits (a uint16 array, "to save memory"):
id 70,000 becomes 4,464, which another token already is, so a suffix matches where it does not, and the draft
holds the wrong ids."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["gives another draft", "past 16 bits"]
HINT = "never keep them in 16 bits"


def answer():
    return (_plant.narrowed(_plant.solved('09_speculative_decoding')['propose_ngram'], 'token_ids'),)

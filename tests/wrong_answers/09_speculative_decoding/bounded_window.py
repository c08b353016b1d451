"""The solved propose_ngram, but it looks only at the last 1,024 token ids ("no prompt is longer than
that"): in a longer sequence an occurrence further back is never found."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["2,048 tokens", "gives another draft", "every earlier position, however far back"]
HINT = "a window of the last tokens"


def answer():
    return (_plant.windowed(_plant.solved('09_speculative_decoding')['propose_ngram'], 'token_ids'),)

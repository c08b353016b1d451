"""The solved propose_ngram behind a memo keyed by id(token_ids): the engine hands a sequence's own list,
which grows in place, so the memo answers for the tokens it held before."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["one list object", "changed in place"]
HINT = "remembered by id(token_ids)"


def answer():
    return (_plant.memo_by_id(_plant.solved('09_speculative_decoding')['propose_ngram']),)

"""The solved prefix cache, but match_prefix keeps its answer by id(token_ids): the engine hands a
sequence's own list, which changes in place, so the memo answers for the tokens it held before."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["changed in place", "a memo keyed on id(token_ids)"]
HINT = "a memo keyed on id(token_ids)"


def answer():
    return (_plant.subclass_with(_plant.solved('08_prefix_caching')['MyPrefixCache'], 'match_prefix', _plant.memo_by_id),)

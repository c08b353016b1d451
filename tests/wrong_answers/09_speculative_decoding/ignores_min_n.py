"""Falls back to shorter n-grams than min_n (down to 1) when nothing of min_n tokens matches."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
EXPECT = ["gives another draft", "return [] (no draft)"]
HINT = "when no suffix of at least min_n tokens occurs earlier, return []"

from _base import good_propose


def my_propose_ngram(token_ids, k, min_n, max_n):
    return good_propose(token_ids, k, min_n, max_n, sizes=lambda L: range(max_n, 0, -1))

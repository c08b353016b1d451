"""Looks for the longest match of any length (max_n ignored)."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
EXPECT = ["gives another draft", "never above it"]
HINT = "n runs from max_n down, never above it"

from _base import good_propose


def my_propose_ngram(token_ids, k, min_n, max_n):
    return good_propose(token_ids, k, min_n, max_n, sizes=lambda L: range(L - 1, min_n - 1, -1))

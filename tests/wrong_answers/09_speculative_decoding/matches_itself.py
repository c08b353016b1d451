"""Counts the suffix itself as an earlier occurrence: it always matches, and nothing follows it."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
EXPECT = ["gives another draft", "END BEFORE the last token"]
HINT = "END BEFORE the last token"

from _base import good_propose


def my_propose_ngram(token_ids, k, min_n, max_n):
    return good_propose(token_ids, k, min_n, max_n, starts=lambda L, n: range(L - n, -1, -1))

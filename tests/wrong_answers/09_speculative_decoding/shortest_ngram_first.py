"""Tries the shortest n-gram first (min_n up to max_n): a short recent match wins over a longer one."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
EXPECT = ["gives another draft", "try n = max_n first"]
HINT = "try n = max_n first"

from _base import good_propose


def my_propose_ngram(token_ids, k, min_n, max_n):
    return good_propose(token_ids, k, min_n, max_n, sizes=lambda L: range(min_n, max_n + 1))

"""Takes the first (oldest) earlier occurrence of the suffix, not the most recent."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
EXPECT = ["gives another draft", "from the end backwards"]
HINT = "search the earlier positions from the end backwards"

from _base import good_propose


def my_propose_ngram(token_ids, k, min_n, max_n):
    return good_propose(token_ids, k, min_n, max_n, starts=lambda L, n: range(0, L - n))

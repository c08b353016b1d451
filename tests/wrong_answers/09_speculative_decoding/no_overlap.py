"""Only counts earlier occurrences that end before the suffix starts (no overlap)."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
EXPECT = ["gives another draft", "may share tokens with the suffix"]
HINT = "an earlier occurrence may share tokens with the suffix"

from _base import good_propose


def my_propose_ngram(token_ids, k, min_n, max_n):
    return good_propose(token_ids, k, min_n, max_n, starts=lambda L, n: range(L - 2 * n, -1, -1))

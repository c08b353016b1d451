"""Returns None when there is no draft."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
EXPECT = ["returned None", "never None"]
HINT = "[] when there is no draft (never None)"

from _base import good_propose


def my_propose_ngram(token_ids, k, min_n, max_n):
    return good_propose(token_ids, k, min_n, max_n) or None

"""Proposes everything that followed the occurrence, not at most k tokens."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
EXPECT = ["gives another draft", "at most k tokens"]
HINT = "propose at most k tokens"

from _base import good_propose


def my_propose_ngram(token_ids, k, min_n, max_n):
    return good_propose(token_ids, k, min_n, max_n, cut=lambda toks, end, k: toks[end:])

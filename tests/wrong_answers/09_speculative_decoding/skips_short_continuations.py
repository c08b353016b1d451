"""Skips an occurrence followed by fewer than k tokens, going on to an older one."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
EXPECT = ["gives another draft", "propose those few"]
HINT = "propose those few: do not skip to an older occurrence"

from _base import good_propose


def my_propose_ngram(token_ids, k, min_n, max_n):
    return good_propose(token_ids, k, min_n, max_n,
                        cut=lambda toks, end, k: toks[end:end + k] if len(toks) - end >= k else None)

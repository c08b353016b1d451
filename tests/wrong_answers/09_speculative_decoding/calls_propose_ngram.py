"""A proposer that calls minipaged's own (minipaged.spec_decode.propose_ngram) from inside a function of its own."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
EXPECT = ["called minipaged.spec_decode.propose_ngram", "minipaged's own implementation"]
HINT = None  # a refusal: the message says what to do, with no hint

from minipaged import spec_decode


def my_propose_ngram(token_ids, k, min_n, max_n):
    return list(spec_decode.propose_ngram(list(token_ids), k, min_n, max_n))

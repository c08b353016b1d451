"""Never allows the stop tokens: a request whose output is a whole choice cannot finish."""
CHECK = "minipaged.checks.structured:check_choice_mask"
EXPECT = ["differs from xgrammar's mask", "allow every id in stop_token_ids"]

from _base import mask


def my_choice_mask(vocab, choices, prefix, stop_token_ids):
    return mask(vocab, choices, prefix, stop_token_ids, stops="never")

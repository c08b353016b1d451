"""Allows the stop tokens at every step, not only when the prefix is a whole choice."""
CHECK = "minipaged.checks.structured:check_choice_mask"
EXPECT = ["differs from xgrammar's mask", "allow the stop tokens only when the prefix is a whole choice"]

from _base import mask


def my_choice_mask(vocab, choices, prefix, stop_token_ids):
    return mask(vocab, choices, prefix, stop_token_ids, stops="always")

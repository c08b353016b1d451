"""Allows SmolLM2's EOS (id 2) at a whole choice, not the stop tokens it is given."""
CHECK = "minipaged.checks.structured:check_choice_mask"
EXPECT = ["differs from xgrammar's mask", "the ones given, not a fixed EOS"]

from _base import mask


def my_choice_mask(vocab, choices, prefix, stop_token_ids):
    return mask(vocab, choices, prefix, stop_token_ids, stops="fixed")

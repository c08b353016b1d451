"""Treats a special token (None in vocab) as empty bytes: it walks nowhere, so it is allowed everywhere."""
CHECK = "minipaged.checks.structured:check_choice_mask"
EXPECT = ["differs from xgrammar's mask", "special token"]

from _base import mask


def my_choice_mask(vocab, choices, prefix, stop_token_ids):
    return mask(vocab, choices, prefix, stop_token_ids, specials=True)

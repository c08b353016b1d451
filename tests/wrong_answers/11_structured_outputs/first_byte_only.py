"""Allows a token when its first byte walks on in the trie: a token that starts along a choice and then diverges
is allowed."""
CHECK = "minipaged.checks.structured:check_choice_mask"
EXPECT = ["differs from xgrammar's mask", "every byte of a token must walk on"]

from _base import mask


def my_choice_mask(vocab, choices, prefix, stop_token_ids):
    return mask(vocab, choices, prefix, stop_token_ids, walk="first")

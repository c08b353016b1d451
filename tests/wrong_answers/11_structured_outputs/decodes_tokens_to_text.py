"""Decodes each token to text first and skips the ones that are not whole characters: a token holding part of a
multi-byte character is refused."""
CHECK = "minipaged.checks.structured:check_choice_mask"
EXPECT = ["differs from xgrammar's mask", "walk the tokens' bytes, not decoded text"]

from _base import mask


def my_choice_mask(vocab, choices, prefix, stop_token_ids):
    return mask(vocab, choices, prefix, stop_token_ids, decode=True)

"""Stops walking at the end of a choice: a token that goes on from a whole choice into a longer one (Pos -> Posh)
is refused."""
CHECK = "minipaged.checks.structured:check_choice_mask"
EXPECT = ["differs from xgrammar's mask", "a whole choice can begin a longer one"]

from _base import mask


def my_choice_mask(vocab, choices, prefix, stop_token_ids):
    return mask(vocab, choices, prefix, stop_token_ids, stop_at_end=True)

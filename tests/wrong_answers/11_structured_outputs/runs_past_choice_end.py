"""Once a token's bytes reach the end of a choice, the rest of the token is not looked at: a token that spans the
end of a choice and goes on is allowed."""
CHECK = "minipaged.checks.structured:check_choice_mask"
EXPECT = ["differs from xgrammar's mask", "must not run past the end of a choice"]

from _base import mask


def my_choice_mask(vocab, choices, prefix, stop_token_ids):
    return mask(vocab, choices, prefix, stop_token_ids, past_end=True)

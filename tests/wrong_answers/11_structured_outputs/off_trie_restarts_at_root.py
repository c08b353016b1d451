"""When the prefix leaves the trie, it starts again at the root instead of allowing nothing."""
CHECK = "minipaged.checks.structured:check_choice_mask"
EXPECT = ["differs from the reference's mask", "no choice begins with the prefix and NO token is allowed"]

from _base import mask


def my_choice_mask(vocab, choices, prefix, stop_token_ids):
    return mask(vocab, choices, prefix, stop_token_ids, off_trie="root")

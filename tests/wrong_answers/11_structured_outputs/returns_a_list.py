"""Returns a list of allowed token ids instead of the mask."""
CHECK = "minipaged.checks.structured:check_choice_mask"
EXPECT = ["returned list", "a torch.bool tensor of shape (49152,)"]

from _base import mask


def my_choice_mask(vocab, choices, prefix, stop_token_ids):
    return mask(vocab, choices, prefix, stop_token_ids).nonzero().flatten().tolist()

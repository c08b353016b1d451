"""A choice mask that calls minipaged's own (minipaged.structured_output.choice_mask) from inside a function of its own."""
CHECK = "minipaged.checks.structured:check_choice_mask"
EXPECT = ["called minipaged.structured_output.choice_mask", "minipaged's own implementation"]

from minipaged import structured_output


def my_choice_mask(vocab, choices, prefix, stop_token_ids):
    return structured_output.choice_mask(vocab, choices, prefix, stop_token_ids).clone()

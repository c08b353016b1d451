"""minipaged's own trie walk passed under another name."""
CHECK = "minipaged.checks.structured:check_choice_mask"
EXPECT = ["minipaged's own choice_mask"]
from minipaged.structured_output import choice_mask as my_choice_mask  # noqa: F401

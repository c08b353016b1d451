"""The learner hands in minipaged's own BlockTable (it has no truncate of the learner's)."""
CHECK = "minipaged.checks.spec_decode:check_truncate"
EXPECT = ["is minipaged's own", "write the class yourself"]
HINT = None  # a refusal: the message says what to do, with no hint

from minipaged import BlockTable as MyBlockTable  # noqa: F401

"""The serving check gets minipaged's own propose_ngram under the learner's name."""
CHECK = "minipaged.checks.spec_decode:check_serving"
EXPECT = ["minipaged's own propose_ngram", "Write yours"]
HINT = None  # a refusal: the message says what to do, with no hint

from minipaged.spec_decode import propose_ngram as my_propose_ngram
from _base import GoodBlockTable


def answer():
    return my_propose_ngram, GoodBlockTable

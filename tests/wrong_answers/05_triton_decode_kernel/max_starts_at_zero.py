"""The running maximum starts at 0 instead of -inf: right until every score of a row is large and negative."""
CHECK = "minipaged.checks.triton_decode:check_decode"
EXPECT = ["scores of one sign only", "is NaN", "Every score of that row is negative", "never at 0"]

from _base import make

my_paged_decode = make(max_from_zero=True)

"""break_even counts k drafts as k tokens (1 + k a), forgetting that a draft counts only when all before it were kept."""
CHECK = "minipaged.checks.predict:check_break_even"
EXPECT = ["break_even", "1 + a + a^2"]
import math


def my_break_even(ratio, k):
    if ratio <= 1:
        return 0.0
    if ratio >= k + 1:
        return math.inf
    return (ratio - 1) / k

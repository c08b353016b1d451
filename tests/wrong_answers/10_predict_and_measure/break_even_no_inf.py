"""break_even answers 1.0 where even full acceptance cannot pay (the rule says inf)."""
CHECK = "minipaged.checks.predict:check_break_even"
EXPECT = ["break_even", "float('inf')"]


def my_break_even(ratio, k):
    if ratio <= 1:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(k + 1)) < ratio else (lo, mid)
    return (lo + hi) / 2

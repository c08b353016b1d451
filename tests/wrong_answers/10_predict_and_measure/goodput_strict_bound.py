"""goodput counts a request right at a target as a miss (< where the rule says <=)."""
CHECK = "minipaged.checks.predict:check_goodput"
EXPECT = ["goodput", "a request right at a target meets it"]


def my_goodput(ttfts, tpots, slo, window_s):
    return sum(1 for a, b in zip(ttfts, tpots) if a < slo["ttft_s"] and b < slo["tpot_s"]) / window_s

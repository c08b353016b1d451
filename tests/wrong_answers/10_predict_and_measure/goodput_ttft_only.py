"""goodput counts the requests that met the TTFT target, whatever their TPOT."""
CHECK = "minipaged.checks.predict:check_goodput"
EXPECT = ["goodput", "BOTH targets"]


def my_goodput(ttfts, tpots, slo, window_s):
    return sum(1 for a in ttfts if a <= slo["ttft_s"]) / window_s

"""goodput returns the fraction of requests that met the SLO, not requests a second."""
CHECK = "minipaged.checks.predict:check_goodput"
EXPECT = ["goodput", "/ window_s"]


def my_goodput(ttfts, tpots, slo, window_s):
    ok = sum(1 for a, b in zip(ttfts, tpots) if a <= slo["ttft_s"] and b <= slo["tpot_s"])
    return ok / max(len(ttfts), 1)

"""speedup_interval uses the population standard deviation (n in the denominator)."""
CHECK = "minipaged.checks.predict:check_ledger"
EXPECT = ["speedup_interval", "statistics.stdev"]
import math
import statistics

from _base import good_ledger, pm, verdict


def interval(control, treatment):
    r = [c / t for c, t in zip(control, treatment)]
    half = pm.T95[len(r) - 1] * statistics.pstdev(r) / math.sqrt(len(r))
    return statistics.mean(r) - half, statistics.mean(r) + half


def answer():
    return good_ledger(), interval, verdict

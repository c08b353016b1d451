"""verdict keeps an optimisation whose interval starts exactly at the bar (>= where the rule says >)."""
CHECK = "minipaged.checks.predict:check_ledger"
EXPECT = ["verdict(1.05, 1.4)", "an end exactly at it included"]
from _base import good_ledger, pm, speedup_interval


def verdict(lo, hi):
    return "keep" if lo >= pm.WORTH else "reject" if hi < pm.WORTH else "inconclusive"


def answer():
    return good_ledger(), speedup_interval, verdict

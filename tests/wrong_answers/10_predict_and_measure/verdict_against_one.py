"""verdict keeps anything surely faster at all (bar 1.0, not 1.05)."""
CHECK = "minipaged.checks.predict:check_ledger"
EXPECT = ["verdict(", "surely at least 5% faster"]
from _base import good_ledger, speedup_interval


def verdict(lo, hi):
    return "keep" if lo > 1.0 else "reject" if hi < 1.0 else "inconclusive"


def answer():
    return good_ledger(), speedup_interval, verdict

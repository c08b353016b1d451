"""All control runs first, then all treatment runs: a slow minute of the machine hits one arm only."""
CHECK = "minipaged.checks.predict:check_ledger"
EXPECT = ["not back to back", "interleave the arms"]
from _base import entry, good_ledger, run, speedup_interval, verdict


def answer():
    ledger = good_ledger()
    c = [run("control", s, order=i) for i, s in enumerate([2.0, 2.1, 1.9])]
    t = [run("treatment", s, order=3 + i) for i, s in enumerate([1.0, 1.1, 0.9])]
    ledger[0] = entry("prefix caching", c, t)
    return ledger, speedup_interval, verdict

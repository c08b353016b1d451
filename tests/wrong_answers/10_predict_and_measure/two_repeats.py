"""The ledger's entries repeat each arm twice."""
CHECK = "minipaged.checks.predict:check_ledger"
EXPECT = ["2 control runs", "at least 3 repeats"]
from _base import entry, good_ledger, pairs, speedup_interval, verdict


def answer():
    ledger = good_ledger()
    ledger[0] = entry("prefix caching", *pairs([2.0, 2.1], [1.0, 1.1]))
    return ledger, speedup_interval, verdict

"""The ledger's interval is typed in, not computed from the entry's own runs."""
CHECK = "minipaged.checks.predict:check_ledger"
EXPECT = ["not the one its own samples give", "own samples"]
from _base import good_ledger, speedup_interval, verdict


def answer():
    ledger = good_ledger()
    ledger[1] = dict(ledger[1], interval=(1.2, 1.4), verdict="keep")
    return ledger, speedup_interval, verdict

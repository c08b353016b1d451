"""The ledger says keep where its own interval holds 1.05 (inconclusive)."""
CHECK = "minipaged.checks.predict:check_ledger"
EXPECT = ["contradicts its interval", "'inconclusive'"]
from _base import good_ledger, speedup_interval, verdict


def answer():
    ledger = good_ledger()
    ledger[1] = dict(ledger[1], verdict="keep")
    return ledger, speedup_interval, verdict

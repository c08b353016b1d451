"""The ledger measures prefix caching only."""
CHECK = "minipaged.checks.predict:check_ledger"
EXPECT = ["no entry 'speculative decoding'"]
from _base import good_ledger, speedup_interval, verdict


def answer():
    return good_ledger()[:1], speedup_interval, verdict

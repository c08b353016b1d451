"""The treatment serves other requests (another seed) than its control."""
CHECK = "minipaged.checks.predict:check_ledger"
EXPECT = ["different requests", "same seeds"]
from _base import entry, good_ledger, pairs, speedup_interval, verdict


def answer():
    ledger = good_ledger()
    c, _ = pairs([2.0, 2.1, 1.9], [1.0, 1.1, 0.9])
    _, t = pairs([2.0, 2.1, 1.9], [1.0, 1.1, 0.9], digest="other seed")
    ledger[0] = entry("prefix caching", c, t)
    return ledger, speedup_interval, verdict

"""speedup_interval divides the arms' means instead of pairing the runs."""
CHECK = "minipaged.checks.predict:check_ledger"
EXPECT = ["speedup_interval", "pair the runs"]
import math
import statistics

from _base import good_ledger, pm, verdict


def interval(control, treatment):
    m = statistics.mean(control) / statistics.mean(treatment)
    half = pm.T95[len(control) - 1] * statistics.stdev(control) / math.sqrt(len(control))
    return m - half, m + half


def answer():
    return good_ledger(), interval, verdict

"""Correct answers of workbook 10 that the wrong answers here change one piece of (not a wrong answer itself)."""
import math
import statistics

from minipaged.checks import predict as pm


def run(arm, seconds, digest="same", order=0):
    """A ledger run as ledger_run would record it (no engine: the check reads only what is recorded)."""
    return pm.LedgerRun(arm, seconds, digest, order, 4)


def speedup_interval(control, treatment):
    r = [c / t for c, t in zip(control, treatment)]
    half = pm.T95[len(r) - 1] * statistics.stdev(r) / math.sqrt(len(r))
    return statistics.mean(r) - half, statistics.mean(r) + half


def verdict(lo, hi):
    return "keep" if lo > pm.WORTH else "reject" if hi < pm.WORTH else "inconclusive"


def entry(name, control, treatment):
    iv = speedup_interval([r.seconds for r in control], [r.seconds for r in treatment])
    return {"optimisation": name, "control": control, "treatment": treatment, "interval": iv, "verdict": verdict(*iv)}


def pairs(c_seconds, t_seconds, start=0, digest="same"):
    c, t = [], []
    for i, (a, b) in enumerate(zip(c_seconds, t_seconds)):
        c.append(run("control", a, digest, start + 2 * i))
        t.append(run("treatment", b, digest, start + 2 * i + 1))
    return c, t


def good_ledger():
    return [entry("prefix caching", *pairs([2.0, 2.1, 1.9], [1.0, 1.1, 0.9])),
            entry("speculative decoding", *pairs([2.0, 2.2, 1.8], [1.9, 2.4, 1.5], start=10))]


def all_reduce_bytes_per_token(num_layers, hidden_size, dtype_bytes):
    return 2 * num_layers * hidden_size * dtype_bytes


def tp_step_time(step_s, n, num_layers, hidden_size, dtype_bytes, batch, link_GBps, latency_s):
    ring = 2 * (n - 1) / n * batch * hidden_size * dtype_bytes
    return step_s / n + 2 * num_layers * (latency_s + ring / (link_GBps * 1e9))


def break_even(verify_cost_ratio, k):
    """The solved break_even: the acceptance a where 1 + a + ... + a^k equals the ratio (bisection)."""
    if verify_cost_ratio <= 1:
        return 0.0
    if verify_cost_ratio >= k + 1:
        return math.inf
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(k + 1)) < verify_cost_ratio:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2

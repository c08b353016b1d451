"""Forgets the scale: softmax(q.k) instead of softmax(q.k * scale)."""
CHECK = "minipaged.checks.paged_attention:check_paged_attention"
EXPECT = ["differs from the reference", "attention without the scale"]

from _base import attention


def my_paged_attention(*args, out=None):
    return attention(*args, scaled=False)

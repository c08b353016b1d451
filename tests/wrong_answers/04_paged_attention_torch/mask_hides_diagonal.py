"""Masks k_pos >= q_pos: a prompt's first token sees no key at all, a softmax over an all -inf row."""
CHECK = "minipaged.checks.paged_attention:check_paged_attention"
EXPECT = ["is NaN", "a softmax over an all -inf row", "k_pos >= q_pos"]
UNEXPECTED = ["overflows", "underflows"]

from _base import attention


def my_paged_attention(*args, out=None):
    return attention(*args, diagonal=False)

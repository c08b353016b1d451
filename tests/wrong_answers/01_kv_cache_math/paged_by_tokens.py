"""max_seqs_paged divides the budget by the tokens, ignoring that blocks are whole."""
CHECK = "minipaged.checks.kv_cache_math:check_max_seqs"
EXPECT = ["max_seqs_paged", "each sequence takes whole blocks"]

from _base import bytes_per_token, max_seqs_contiguous as my_max_seqs_contiguous


def my_max_seqs_paged(m, budget_bytes, num_tokens, block_size):
    return budget_bytes // (num_tokens * bytes_per_token(m))


def answer():
    return my_max_seqs_contiguous, my_max_seqs_paged

"""max_seqs_contiguous uses / and returns a fraction of a sequence."""
CHECK = "minipaged.checks.kv_cache_math:check_max_seqs"
EXPECT = ["max_seqs_contiguous", "float", "// (floor division)"]

from _base import bytes_per_token, max_seqs_paged as my_max_seqs_paged


def my_max_seqs_contiguous(m, budget_bytes, max_model_len):
    return budget_bytes / (max_model_len * bytes_per_token(m))


def answer():
    return my_max_seqs_contiguous, my_max_seqs_paged

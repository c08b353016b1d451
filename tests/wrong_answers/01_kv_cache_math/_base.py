"""Correct answers that the wrong answers here change one of (not a wrong answer itself)."""


def bytes_per_token(m):
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes


def bytes_per_sequence(m, num_tokens, block_size):
    return -(-num_tokens // block_size) * block_size * bytes_per_token(m)


def max_seqs_contiguous(m, budget_bytes, max_model_len):
    return budget_bytes // (max_model_len * bytes_per_token(m))


def max_seqs_paged(m, budget_bytes, num_tokens, block_size):
    return (budget_bytes // (block_size * bytes_per_token(m))) // -(-num_tokens // block_size)
